// torchmem's counting CPU allocator.
//
// Installed as PyTorch's default CPU allocator, it allocates exactly as that one does (c10::alloc_cpu / c10::free_cpu, reporting to torch.profiler through
// c10::profiledCPUMemoryReporter) and counts every storage of the process, in every
// thread, in atomics that Python reads directly. Loaded with ctypes: a C ABI only.
//
// Each block carries a header of kHeader bytes before the data, holding the block's
// size, so that the deleter knows what it frees. The DataPtr's context is its data
// pointer, as with the default allocator: code that checks that (oneDNN) keeps working.
//
// Storages made before the allocator was installed are adopted: their deleter (the
// default allocator's) is swapped for one that counts them off when they die.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

#include <pthread.h>

#include <atomic>
#include <cstring>
#include <cstdint>
#include <mutex>
#include <new>
#include <string>
#include <typeinfo>
#include <unordered_map>

namespace {

constexpr size_t kHeader = c10::gAlignment < 64 ? 64 : c10::gAlignment;

// The layout Python reads: one int64 each, in this order.
struct Counters {
  std::atomic<int64_t> current{0};    // bytes of live storages
  std::atomic<int64_t> peak{0};       // highest `current` since the last reset
  std::atomic<int64_t> allocated{0};  // bytes allocated since install
  std::atomic<int64_t> freed{0};      // bytes freed since install (adopted ones too)
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> frees{0};
  std::atomic<int64_t> adopted{0};    // bytes adopted (made before install)
};
static_assert(sizeof(std::atomic<int64_t>) == sizeof(int64_t), "plain int64 layout");

// Never destroyed: storages may die during interpreter shutdown, after static
// destructors would have run.
Counters& counters = *new Counters();
std::mutex& adopted_mutex = *new std::mutex();
std::unordered_map<void*, int64_t>& adopted_sizes = *new std::unordered_map<void*, int64_t>();
c10::DeleterFnPtr default_deleter = nullptr;

inline void grow(int64_t n) {
  int64_t now = counters.current.fetch_add(n, std::memory_order_relaxed) + n;
  int64_t peak = counters.peak.load(std::memory_order_relaxed);
  while (now > peak &&
         !counters.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

inline void shrink(int64_t n) {
  counters.current.fetch_sub(n, std::memory_order_relaxed);
  counters.freed.fetch_add(n, std::memory_order_relaxed);
  counters.frees.fetch_add(1, std::memory_order_relaxed);
}

void delete_counted(void* data) {
  if (data == nullptr) {
    return;
  }
  char* block = static_cast<char*>(data) - kHeader;
  shrink(*reinterpret_cast<int64_t*>(block));
  c10::profiledCPUMemoryReporter().Delete(data);
  c10::free_cpu(block);
}

void delete_adopted(void* data) {
  int64_t n = 0;
  {
    std::lock_guard<std::mutex> lock(adopted_mutex);
    auto it = adopted_sizes.find(data);
    if (it != adopted_sizes.end()) {
      n = it->second;
      adopted_sizes.erase(it);
    }
  }
  if (n) {
    shrink(n);
  }
  default_deleter(data);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return {nullptr, nullptr, &delete_counted, cpu};
    }
    void* block = nullptr;
    try {
      block = c10::alloc_cpu(n + kHeader);
    } catch (c10::Error& error) {
      c10::profiledCPUMemoryReporter().OutOfMemory(n);
      // c10's message names the size asked of it: name the caller's instead (in a plain
      // c10::Error only; a subclass is rethrown as it is, keeping its Python type).
      std::string message = error.msg();
      const std::string asked = std::to_string(n + kHeader);
      const size_t at = message.find(asked);
      if (at == std::string::npos || typeid(error) != typeid(c10::Error)) {
        throw;
      }
      message.replace(at, asked.size(), std::to_string(n));
      throw c10::Error(message, error.backtrace(), error.caller());
    }
    *static_cast<int64_t*>(block) = static_cast<int64_t>(n);
    void* data = static_cast<char*>(block) + kHeader;
    counters.allocated.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
    counters.allocations.fetch_add(1, std::memory_order_relaxed);
    grow(static_cast<int64_t>(n));
    c10::profiledCPUMemoryReporter().New(data, n);
    return {data, data, &delete_counted, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_counted; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// PyTorch's default CPU allocator object, and its original virtual table pointer.
c10::Allocator* allocator = nullptr;
void* standard_vtable = nullptr;

}  // namespace

extern "C" {

// Makes PyTorch's default CPU allocator count, once per process. Returns 0, or 1 where
// another allocator than PyTorch's default is in place (its owner chose it: torchmem
// does not replace it).
//
// The default allocator object itself becomes a CountingAllocator (its virtual table
// pointer is replaced; neither class has data members), rather than a new allocator
// being registered with c10::SetCPUAllocator: Python's storage constructors
// (torch.UntypedStorage(n), which copy.deepcopy, pickle and torch.load use) call
// c10::GetDefaultCPUAllocator() directly, and must be counted too.
int torchmem_install() {
  c10::Allocator* standard = c10::GetDefaultCPUAllocator();
  if (c10::GetCPUAllocator() != standard) {
    return 1;
  }
  if (allocator == nullptr) {
    default_deleter = standard->raw_deleter();
    std::memcpy(&standard_vtable, static_cast<void*>(standard), sizeof(void*));
    // The adopted sizes' lock must be free in a child made by fork (DataLoader's
    // workers): hold it across fork so that no other thread holds it then.
    pthread_atfork([] { adopted_mutex.lock(); }, [] { adopted_mutex.unlock(); },
                   [] { adopted_mutex.unlock(); });
    static_assert(sizeof(CountingAllocator) == sizeof(c10::Allocator), "no data members");
    allocator = new (static_cast<void*>(standard)) CountingAllocator();
  }
  return 0;
}

// Gives PyTorch its default CPU allocator back (after a failed self-test). Storages the
// counting allocator made keep its deleter, which stays valid.
void torchmem_uninstall() {
  if (allocator != nullptr) {
    std::memcpy(static_cast<void*>(allocator), &standard_vtable, sizeof(void*));
    allocator = nullptr;
  }
}

// The counters, as seven int64 in the order of struct Counters.
int64_t* torchmem_counters() { return reinterpret_cast<int64_t*>(&counters); }

// Restarts the peak at the current bytes.
void torchmem_reset_peak() {
  counters.peak.store(counters.current.load(std::memory_order_relaxed),
                      std::memory_order_relaxed);
}

// Adopts a CPU storage made by the default allocator before install (a c10::StorageImpl*,
// which Python's UntypedStorage._cdata is): counts its bytes now and off when it dies.
// Returns the bytes adopted,
// 0 for a storage that is counted already or not the default allocator's.
int64_t torchmem_adopt(void* storage_impl) {
  auto* storage = static_cast<c10::StorageImpl*>(storage_impl);
  if (allocator == nullptr || storage->device_type() != c10::DeviceType::CPU) {
    return 0;
  }
  c10::DataPtr& ptr = storage->_mutable_data_ptr_no_checks();
  void* data = ptr.get();
  int64_t n = static_cast<int64_t>(storage->nbytes());
  if (data == nullptr || n == 0 || ptr.get_context() != data) {
    return 0;
  }
  {
    std::lock_guard<std::mutex> lock(adopted_mutex);
    if (!ptr.compare_exchange_deleter(default_deleter, &delete_adopted)) {
      return 0;
    }
    adopted_sizes[data] = n;
  }
  counters.adopted.fetch_add(n, std::memory_order_relaxed);
  grow(n);
  return n;
}

// Allocates and frees `n` bytes through PyTorch's CPU allocator and checks that the
// counters saw both. Returns 0 when they did.
int torchmem_self_test(int64_t n) {
  if (allocator == nullptr || c10::GetCPUAllocator() != allocator) {
    return 1;
  }
  int64_t allocated = counters.allocated.load();
  int64_t freed = counters.freed.load();
  {
    c10::DataPtr ptr = c10::GetCPUAllocator()->allocate(static_cast<size_t>(n));
    if (counters.allocated.load() - allocated < n || ptr.get_deleter() != &delete_counted) {
      return 2;
    }
  }
  return counters.freed.load() - freed < n ? 3 : 0;
}

}  // extern "C"
