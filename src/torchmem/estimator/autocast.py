"""CUDA's autocast, run on the fake CPU.

The estimator runs a CUDA step on fake CPU tensors, so ``torch.autocast("cuda", dtype)``
turns CPU autocast on. CPU autocast casts other operators than CUDA's, and memory follows
the casts: under CUDA autocast ``exp``, ``sum`` and ``softmax`` run in float32 and
``einsum`` in the lower precision, where CPU autocast leaves the first three alone and
casts ``einsum``'s matrix products only after reshaping their inputs. :class:`CudaRules`
gives CPU autocast CUDA's rules while it is in place: for each operator on CUDA's lists,
a kernel on the ``AutocastCPU`` dispatch key that casts as CUDA's does (its cache of
parameters' casts included), and for each operator only CPU autocast casts, a kernel
that passes it through uncast. The lists are those of PyTorch's
``aten/src/ATen/autocast_mode.h`` for CUDA, read for the version torchmem pins.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchmem._compat.fake import op_schema, view_base

LOWER = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip
"""Operators CUDA autocast runs in the lower precision."""
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
    "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip
"""Operators CUDA autocast runs in float32 (their inputs cast up)."""
FLOAT32_OUTPUT = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)  # fmt: skip
"""Operators CUDA autocast gives ``dtype=torch.float32`` where no dtype is given (their
inputs stay as they are)."""
FLOAT32_OVERLOAD = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
"""Operators CUDA autocast runs as their overload with a dtype, float32."""
WIDEST = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)  # fmt: skip
"""Operators CUDA autocast runs in the widest floating type among their inputs."""
BANNED = ("binary_cross_entropy",)
"""Operators CUDA autocast refuses (they raise on a GPU)."""
CPU_ONLY = (
    "_addmm_activation", "_grid_sampler_2d_cpu_fallback", "_lu_with_info",
    "_native_multi_head_attention", "adaptive_avg_pool3d", "adaptive_max_pool3d",
    "avg_pool3d", "cat", "cholesky", "cholesky_inverse", "cholesky_solve", "conv1d.padding",
    "conv2d.padding", "conv3d.padding", "cross_entropy_loss", "ctc_loss.IntList",
    "ctc_loss.Tensor", "fake_quantize_per_tensor_affine", "fft_fft", "fft_fft2", "fft_fftn",
    "fft_hfft", "fft_ifft", "fft_ifft2", "fft_ifftn", "fft_ihfft", "fft_irfft", "fft_irfft2",
    "fft_irfftn", "fft_rfft", "fft_rfft2", "fft_rfftn", "fractional_max_pool2d",
    "fractional_max_pool3d", "geqrf", "grid_sampler_2d", "grid_sampler_3d", "index_copy",
    "inverse", "linalg_cholesky", "linalg_cholesky_ex", "linalg_cond", "linalg_cond.p_str",
    "linalg_eig", "linalg_eigh", "linalg_eigvals", "linalg_eigvalsh",
    "linalg_householder_product", "linalg_inv", "linalg_inv_ex", "linalg_lstsq",
    "linalg_matrix_rank", "linalg_matrix_rank.atol_rtol_float",
    "linalg_matrix_rank.atol_rtol_tensor", "linalg_matrix_rank.tol_tensor", "linalg_qr",
    "linalg_solve", "linalg_svd", "linalg_svdvals", "linalg_tensorinv", "linalg_tensorsolve",
    "lu_solve", "max_pool3d", "max_unpool2d", "max_unpool3d", "mkldnn_rnn_layer",
    "multilabel_margin_loss_forward", "nanquantile", "nanquantile.scalar", "orgqr", "ormqr",
    "pinverse", "polar", "qr", "quantile", "quantile.scalar", "reflection_pad1d",
    "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "stack", "stft", "stft.center", "svd", "trace", "triangular_solve", "view_as_complex",
)  # fmt: skip
"""Operators CPU autocast casts and CUDA autocast does not: they run uncast."""


def _operator(name: str) -> Any:
    """The ``torch.ops.aten`` overload called `name` (``"pow.Scalar"``; no overload: the
    default one), or None where this PyTorch has none."""
    packet, _, overload = name.partition(".")
    found = getattr(torch.ops.aten, packet, None)
    return getattr(found, overload or "default", None) if found is not None else None


class CudaRules:
    """While in place (``with CudaRules(on_gpu):``), CPU autocast casts as CUDA autocast
    does, and only the tensors `on_gpu` says are on the GPU, as CUDA autocast casts CUDA
    tensors only. The casts of parameters to the lower precision are cached until the
    outermost autocast block ends, as on CUDA. Process-wide while in place: CPU autocast
    in another thread casts by the same rules."""

    def __init__(self, on_gpu: Callable[[torch.Tensor], bool]) -> None:
        self.on_gpu = on_gpu
        self._library: Any = None
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._clear: Callable[[], None] | None = None

    def __enter__(self) -> CudaRules:
        library: Any = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        policies: list[tuple[Iterable[str], Callable[[Any, str], Callable[..., Any]]]] = [
            (LOWER, self._lower),
            (FLOAT32, self._float32),
            (FLOAT32_OUTPUT, self._float32_output),
            (FLOAT32_OVERLOAD, self._float32_overload),
            (WIDEST, self._widest),
            (BANNED, self._banned),
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for names, policy in policies:
                for name in names:
                    op = _operator(name)
                    if op is not None:
                        library.impl(op, policy(op, name), "AutocastCPU")
            for name in CPU_ONLY:
                op = _operator(name)
                if op is not None:
                    library.impl(op, torch.library.fallthrough_kernel, "AutocastCPU")
        self._library = library
        self._clear = torch.clear_autocast_cache

        def clear() -> None:
            self._cache.clear()
            assert self._clear is not None
            self._clear()

        torch.clear_autocast_cache = clear  # what the outermost autocast block calls at its end
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._clear is not None:
            torch.clear_autocast_cache = self._clear
            self._clear = None
        self._cache.clear()
        # A Library's kernels are taken out when the object is collected (no cycles hold it).
        self._library = None

    # Policies: each returns the kernel of one operator --------------------------------

    def _run(self, op: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run `op` with CPU autocast off, as autocast's own kernels run theirs."""
        torch.set_autocast_enabled("cpu", False)
        try:
            return op(*args, **kwargs)
        finally:
            torch.set_autocast_enabled("cpu", True)

    def _lower(self, op: Any, name: str) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            low = torch.get_autocast_dtype("cpu")
            return self._run(op, *self._cast(low, args, kwargs))

        return kernel

    def _float32(self, op: Any, name: str) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            return self._run(op, *self._cast(torch.float32, args, kwargs))

        return kernel

    def _float32_output(self, op: Any, name: str) -> Callable[..., Any]:
        place = next(
            (
                i
                for i, a in enumerate(op_schema(op).arguments)
                if a.name == "dtype" and not a.kwarg_only
            ),
            None,
        )

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if args and self._eligible(args[0]):
                if place is not None and len(args) > place:
                    if args[place] is None:
                        args = (*args[:place], torch.float32, *args[place + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return self._run(op, args, kwargs)

        return kernel

    def _float32_overload(self, op: Any, name: str) -> Callable[..., Any]:
        typed = _operator(FLOAT32_OVERLOAD[name])

        def kernel(*args: Any, **kwargs: Any) -> Any:
            first = args[0]
            dtype = torch.float32 if self._eligible(first) else first.dtype
            if len(args) == 1:  # norm.Scalar's p, left at its default
                args = (first, 2)
            return self._run(typed, args, {**kwargs, "dtype": dtype})

        return kernel

    def _widest(self, op: Any, name: str) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            dtype = torch.get_autocast_dtype("cpu")
            for tensor in _tensors((*args, *kwargs.values())):
                if self._eligible(tensor) and tensor.dtype == torch.float32:
                    dtype = torch.float32
            return self._run(op, *self._cast(dtype, args, kwargs))

        return kernel

    def _banned(self, op: Any, name: str) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"torch.nn.functional.{name} is unsafe to autocast, and CUDA autocast refuses"
                " it: use binary_cross_entropy_with_logits"
            )

        return kernel

    # Casts ------------------------------------------------------------------------------

    def _eligible(self, value: object) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.dtype is not torch.float64
            and self.on_gpu(value)
        )

    def _cast(
        self, dtype: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # Last argument first, as CUDA's kernels cast them (each cast allocates: the
        # order places the blocks).
        cast_kwargs = {k: self._cast_one(dtype, kwargs[k]) for k in reversed(kwargs)}
        cast_args = [self._cast_one(dtype, a) for a in reversed(args)]
        return tuple(reversed(cast_args)), cast_kwargs

    def _cast_one(self, dtype: torch.dtype, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(reversed([self._cast_one(dtype, v) for v in reversed(value)]))
        if not self._eligible(value) or value.dtype == dtype:
            return value
        cached = (
            dtype == torch.get_autocast_dtype("cpu")
            and value.dtype == torch.float32
            and value.requires_grad
            and value.is_leaf
            and view_base(value) is None
            and torch.is_autocast_cache_enabled()
        )
        if not cached:
            return value.to(dtype)
        hit = self._cache.get(id(value))
        if hit is not None and hit[0]() is value:
            return hit[1]
        cast = value.to(dtype)
        self._cache[id(value)] = (weakref.ref(value), cast)
        return cast


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _tensors(value)
        elif isinstance(value, torch.Tensor):
            yield value
