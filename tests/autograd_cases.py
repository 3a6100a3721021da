"""Autograd programs whose outcome (the gradients, or the error autograd raises) must be
the same under torchmem as under ``python``: tensors saved for backward and modified in
place since (autograd's version check), retained graphs, double backward, checkpointing,
custom functions, the program's own saved-tensor hooks, anomaly detection. Run as a script,
it prints each case's outcome."""

import torch
from torch import nn


def inplace_input():
    a = torch.ones(3, requires_grad=True)
    b = a * 2
    c = b * b
    b.add_(1)
    c.sum().backward()
    return a.grad


def inplace_output():
    x = torch.ones(3, requires_grad=True)
    y = x.exp()
    y.add_(1)
    y.sum().backward()
    return x.grad


def inplace_leaf_alias():
    w = torch.ones(3, requires_grad=True)
    z = w * w
    w.detach().add_(1)
    z.sum().backward()
    return w.grad


def inplace_through_view():
    x = torch.ones(4, requires_grad=True)
    y = x.clone()
    z = y * y
    y[:2].mul_(2)
    z.sum().backward()
    return x.grad


def inplace_second_output():
    x = torch.ones(2, 3, requires_grad=True)
    values, _ = x.max(1)
    w = values * values
    values.add_(1)
    w.sum().backward()
    return x.grad


def inplace_function_output():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            return grad * y

    x = torch.ones(3, requires_grad=True)
    y = Twice.apply(x)
    y.add_(1)
    y.sum().backward()
    return x.grad


def lstm_hidden_kept():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8)
    head = nn.Linear(8, 1)
    opt = torch.optim.Adam([*lstm.parameters(), *head.parameters()])
    hidden = None
    for _ in range(3):
        out, hidden = lstm(torch.randn(5, 2, 4), hidden)
        loss = head(out).pow(2).mean()
        opt.zero_grad()
        loss.backward(retain_graph=True)
        opt.step()
    return head.weight.grad


def retain_graph_then_inplace():
    x = torch.ones(3, requires_grad=True)
    y = x.sigmoid()
    y.sum().backward(retain_graph=True)
    y.mul_(2)
    y.sum().backward()
    return x.grad


def retain_graph_twice():
    x = torch.ones(3, requires_grad=True)
    y = (x * x).sigmoid()
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    return x.grad


def double_backward():
    x = torch.ones(3, requires_grad=True)
    (g,) = torch.autograd.grad((x**3).sum(), x, create_graph=True)
    g.sum().backward()
    return x.grad


def double_backward_inplace():
    x = torch.ones(3, requires_grad=True)
    y = x * 1
    (g,) = torch.autograd.grad((y**3).sum(), y, create_graph=True)
    y.add_(1)
    g.sum().backward()
    return x.grad


def checkpointed(reentrant):
    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
        x = torch.randn(2, 4, requires_grad=True)
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant).sum().backward()
        return x.grad

    return run


def checkpoint_inplace():
    def block(x):
        y = x.exp()
        y.add_(1)
        return y

    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    return x.grad


def user_hooks():
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    x = torch.ones(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = x.exp()
        y.add_(1)  # under the user's own hooks PyTorch does not check: no error
    y.sum().backward()
    return x.grad, len(seen)


def anomaly_inplace():
    with torch.autograd.set_detect_anomaly(True):
        x = torch.ones(3, requires_grad=True)
        y = x.tanh()
        y.add_(1)
        y.sum().backward()
    return x.grad


def relu_inplace_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    out = model(torch.randn(2, 4))
    out += 1
    out.sum().backward()
    return model[0].weight.grad


CASES = {
    name: case
    for name, case in [
        ("inplace_input", inplace_input),
        ("inplace_output", inplace_output),
        ("inplace_leaf_alias", inplace_leaf_alias),
        ("inplace_through_view", inplace_through_view),
        ("inplace_second_output", inplace_second_output),
        ("inplace_function_output", inplace_function_output),
        ("lstm_hidden_kept", lstm_hidden_kept),
        ("retain_graph_then_inplace", retain_graph_then_inplace),
        ("retain_graph_twice", retain_graph_twice),
        ("double_backward", double_backward),
        ("double_backward_inplace", double_backward_inplace),
        ("checkpoint_reentrant", checkpointed(True)),
        ("checkpoint", checkpointed(False)),
        ("checkpoint_inplace", checkpoint_inplace),
        ("user_hooks", user_hooks),
        ("anomaly_inplace", anomaly_inplace),
        ("relu_inplace_model", relu_inplace_model),
    ]
}


def outcome(case):
    try:
        return ("ok", repr(case()))
    except RuntimeError as error:
        return ("raised", str(error))


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")  # anomaly detection's warning names this file's path
    for name, case in CASES.items():
        print(name, *outcome(case))
