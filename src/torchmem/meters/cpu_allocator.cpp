// torchmem's counting CPU allocator.
//
// Installed as PyTorch's default CPU allocator, it allocates exactly as that one does (c10::alloc_cpu / c10::free_cpu, reporting to torch.profiler through
// c10::profiledCPUMemoryReporter) and counts every storage of the process, in every
// thread, in atomics that Python reads directly. Loaded with ctypes: a C ABI only.
//
// Each block carries a header of kHeader bytes before the data, holding the block's
// size, so that the deleter knows what it frees. The DataPtr's context is its data
// pointer, as with the default allocator: code that checks that (oneDNN) keeps working.
// Blocks that c10 aligns to the page (huge-page allocations, THP_MEM_ALLOC_ENABLE=1) have
// no header: a header would move their data off the page (see "Paged blocks").
//
// Storages made before the allocator was installed are adopted: their deleter (the
// default allocator's) is swapped for one that counts them off when they die. Storages
// that other allocators make (shared memory, mapped files, pinned memory) are counted
// from Python as they come and go: see "Storages the allocator did not make".
//
// While a recording runs (torchmem.record, torchmem run), every allocation and free is
// also appended to an event log, with the allocation's site: the frame that
// torchmem.records.frames.choose picks from the allocating thread's Python stack (compiled
// in where Python's headers are found, TORCHMEM_PYTHON), and that whole stack: a row names
// it by its index in a table that keeps each distinct stack once. The log is a stream of
// rows that Python drains as it fills (torchmem.events.tally counts them): a free names
// its allocation by sequence number, and Python adds rows of its own in order (what a
// storage is, a module's pass starting).
//
// What this file relies on -------------------------------------------------------------
//
// PyTorch (c10); those marked [checked] are checked by torchmem_install before anything
// is replaced, or by torchmem_self_test after, and the allocator is not used where they
// fail:
// - c10::GetDefaultCPUAllocator() is c10::DefaultCPUAllocator, and no other allocator is
//   set for the CPU [checked]. That class has no data members: the object can become a
//   CountingAllocator by its virtual table pointer alone (one pointer at offset 0, as the
//   Itanium C++ ABI of GCC and Clang lays it out), and c10 calls it only virtually.
// - Its allocate(n) gives {data, data, raw_deleter()} from c10::alloc_cpu, data aligned to
//   c10::gAlignment [checked]: adoption swaps exactly that deleter, and kHeader keeps that
//   alignment. This file's c10::gAlignment is the library's [checked on Linux, where c10
//   exports c10_compute_alignment].
// - c10::alloc_cpu(n) aligns to c10::c10_compute_alignment(n): the page for huge-page
//   allocations, else gAlignment. It throws c10::Error when there is no memory, as
//   allocate() must then; c10::free_cpu frees what it gave.
// - raw_deleter() frees any pointer that allocate() gave with its context released
//   (Allocator::raw_allocate / raw_deallocate) [checked]: delete_counted takes both kinds.
// - A deleter runs once, in any thread, from destructors that are noexcept, possibly while
//   the process exits, after static destructors ran: deleters never throw, and what they
//   touch is never destroyed. allocate() either fails whole (the block given back, nothing
//   counted) or nothing after its counters can throw.
// - c10::StorageImpl::_mutable_data_ptr_no_checks and DataPtr::compare_exchange_deleter
//   (adoption). A storage's DataPtr changes only inside operators (resize_, set_), which
//   Python code starts: adoption holds the GIL.
//
// CPython, where TORCHMEM_PYTHON: see the notes above python_site. In short: a site is
// read from the allocating thread's own frames without the GIL, into C++ tables under a
// mutex of their own; the functions that make Python objects are called with the GIL
// held (ctypes.PyDLL); a thread that Python does not know is never given a thread state.
//
// The platform: std::mutex and the C++ library do not throw except std::bad_alloc, and
// std::mutex::lock does not fail on a mutex of this file (a thread never takes one it
// holds).

#ifdef TORCHMEM_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>  // first, as Python asks
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h>  // PyFrame_GetLineNumber: in Python.h from 3.11 on
#endif
#if defined(Py_GIL_DISABLED) || PY_VERSION_HEX >= 0x030E0000
// The frame walk (see python_site) knows the frames of Python 3.10 to 3.13 with the GIL:
// another Python records no sites.
#undef TORCHMEM_PYTHON
#elif PY_VERSION_HEX >= 0x030B0000
#if PY_VERSION_HEX >= 0x030C0000
#undef _PyGC_FINALIZED  // python/cpython#105268: core and non-core headers mixed (3.12)
#endif
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>  // the frames' layout, as PyTorch's own C++ reads it
#undef Py_BUILD_CORE
#endif
#endif

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kHeader = c10::gAlignment < 64 ? 64 : c10::gAlignment;
static_assert(kHeader % c10::gAlignment == 0 && kHeader >= sizeof(int64_t),
              "the data after a header keeps c10's alignment; the header holds the size");

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
static_assert(sizeof(Counters) == 7 * sizeof(int64_t), "seven int64, as Python reads them");
static_assert(std::atomic<int64_t>::is_always_lock_free, "Python reads them as plain int64");

// Never destroyed: storages may die during interpreter shutdown, after static
// destructors would have run.
Counters& counters = *new Counters();
std::mutex& adopted_mutex = *new std::mutex();
std::unordered_map<void*, int64_t>& adopted_sizes = *new std::unordered_map<void*, int64_t>();
c10::DeleterFnPtr default_deleter = nullptr;

// Rows the log had no memory for (torchmem_dropped_rows), since install: a recording that
// lost some cannot be exact, and its report says so.
std::atomic<int64_t> dropped_rows{0};

// Paged blocks --------------------------------------------------------------------------
//
// With THP_MEM_ALLOC_ENABLE=1, c10::alloc_cpu aligns allocations of 2 MiB and more to the
// page, so that the kernel can back them with huge pages. A header would put their data
// kHeader bytes past the page, and a whole page for the header would waste a page each
// (a huge page, once the kernel backs the block with them): they are allocated as c10
// allocates them, without a header, and their sizes are kept here. Such blocks are few
// and large, so one table under a mutex costs nothing that matters.
//
// The invariant: a block is paged if and only if its data pointer is in paged_sizes,
// from its allocation until its deleter; its DataPtr's deleter is delete_paged, every
// other block's is delete_counted, and delete_counted (the raw deleter, which gets only
// a pointer) looks here first for a page-aligned pointer once a paged block was made.
std::mutex& paged_mutex = *new std::mutex();
std::unordered_map<void*, int64_t>& paged_sizes = *new std::unordered_map<void*, int64_t>();
std::atomic<size_t> paged_alignment{0};  // the page, once a paged block was made; 0 before

// The alignment c10::alloc_cpu gives n bytes.
inline size_t c10_alignment(size_t n) {
#if defined(__linux__) && !defined(__ANDROID__)
  return c10::c10_compute_alignment(n);
#else
  return c10::gAlignment;  // c10 aligns to the page on Linux only
#endif
}

// Whether c10::alloc_cpu aligns n bytes to the page.
inline bool paged(size_t n) {
  return n >= c10::gAlloc_threshold_thp && c10_alignment(n) != c10::gAlignment;
}

// The size of the paged block at data, taken out of the table; 0 where data is not one.
int64_t forget_paged(void* data) noexcept {
  std::lock_guard<std::mutex> lock(paged_mutex);
  auto found = paged_sizes.find(data);
  if (found == paged_sizes.end()) {
    return 0;
  }
  const int64_t n = found->second;
  paged_sizes.erase(found);
  return n;
}

// The recording ------------------------------------------------------------------------

// One row of the stream torchmem.events.tally reads, as six int64 in this order.
struct Event {
  int64_t time_ns;  // steady clock: CLOCK_MONOTONIC, as Python's time.monotonic_ns()
  int64_t ptr;      // the data pointer (a probe: its number)
  int64_t size;     // bytes; negative for a free
  int64_t site;     // an allocation's stack index (or kNoSite, kNoPython, kNoFrame); payload
  int64_t ref;      // the sequence number of the allocation a free, mark or adoption names
  int64_t kind;     // kAlloc, kFree, or what Python noted (torchmem.events.tally.KINDS)
};
static_assert(sizeof(Event) == 6 * sizeof(int64_t), "six int64");

constexpr int64_t kNoSite = -1;    // sites are not recorded
constexpr int64_t kNoPython = -2;  // a thread Python does not know (intra-op workers)
constexpr int64_t kNoFrame = -3;   // no Python frame on the stack
constexpr int64_t kAlloc = 0;
constexpr int64_t kFree = 1;
constexpr int64_t kAdopt = 2;
constexpr int64_t kOtherCategory = 6;  // torchmem.records.run.CATEGORIES: "other"
constexpr size_t kKeptCapacity = size_t{1} << 18;  // rows the drained log may keep room for

// A storage alive while recording: its allocation's sequence number, and the lowest
// category a mark gave it since the latest recording started (a mark that gives none
// lower is not logged; a recording that starts inside another hears each mark anew).
struct Live {
  int64_t seq;
  int64_t category;
  int64_t generation;
};

// 0: not recording; 1: recording; 2: recording with sites.
//
// The log is a stream that Python drains (torchmem_record_take) while the recording
// runs: its memory is bounded by what accumulates between two drains, not by the run.
// Each row's sequence number is its place in the whole stream: taken + its index.
std::atomic<int> recording{0};
std::mutex& log_mutex = *new std::mutex();
std::vector<Event>& events = *new std::vector<Event>();
int64_t taken = 0;  // rows drained since the recording started
int64_t generation = 0;  // recordings started (those inside another too)

// The storages alive while recording, by data pointer: an open-addressing table (linear
// probing, deletion by shifting back), so that an allocation and its free make no node of
// a std::unordered_map each (a malloc and a free apiece). Never throws: a table that has
// no memory to grow into stays as it was, and says so. Guarded by log_mutex.
class LiveTable {
 public:
  Live* find(void* key) noexcept {
    if (slots_ == nullptr) {
      return nullptr;
    }
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) {
        return &slots_[i].value;
      }
      if (slots_[i].key == nullptr) {
        return nullptr;
      }
    }
  }

  // Sets key's value; false where the table had no memory to grow (it is as it was).
  bool put(void* key, const Live& value) noexcept {
    if (2 * (size_ + 1) > mask_ + 1 && !grow()) {
      return false;
    }
    size_t i = home(key);
    while (slots_[i].key != nullptr && slots_[i].key != key) {
      i = (i + 1) & mask_;
    }
    size_ += slots_[i].key == nullptr;
    slots_[i] = {key, value};
    return true;
  }

  // Removes key; its value was at `found` (from find).
  void erase(Live* found) noexcept {
    size_t i = static_cast<size_t>(reinterpret_cast<Slot*>(reinterpret_cast<char*>(found) -
                                                            offsetof(Slot, value)) -
                                   slots_);
    for (size_t j = (i + 1) & mask_; slots_[j].key != nullptr; j = (j + 1) & mask_) {
      // The entry at j moves back to i unless its home lies cyclically in (i, j].
      const size_t k = home(slots_[j].key);
      if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) {
        continue;
      }
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i].key = nullptr;
    --size_;
  }

  void clear() noexcept {
    std::free(slots_);
    slots_ = nullptr;
    mask_ = size_ = 0;
  }

 private:
  struct Slot {
    void* key;  // null: empty
    Live value;
  };

  size_t home(void* key) const noexcept {  // Fibonacci hashing of the pointer
    return static_cast<size_t>((reinterpret_cast<uintptr_t>(key) * 0x9E3779B97F4A7C15ull) >>
                               shift_) &
           mask_;
  }

  bool grow() noexcept {
    const size_t capacity = slots_ == nullptr ? 1024 : 2 * (mask_ + 1);
    auto* fresh = static_cast<Slot*>(std::calloc(capacity, sizeof(Slot)));
    if (fresh == nullptr) {
      return false;
    }
    Slot* old = slots_;
    const size_t old_capacity = slots_ == nullptr ? 0 : mask_ + 1;
    slots_ = fresh;
    mask_ = capacity - 1;
    shift_ = 64 - __builtin_ctzll(capacity);
    for (size_t i = 0; i < old_capacity; ++i) {
      if (old[i].key != nullptr) {
        size_t j = home(old[i].key);
        while (slots_[j].key != nullptr) {
          j = (j + 1) & mask_;
        }
        slots_[j] = old[i];
      }
    }
    std::free(old);
    return true;
  }

  Slot* slots_ = nullptr;
  size_t mask_ = 0;
  size_t size_ = 0;
  int shift_ = 64;
};
LiveTable& live = *new LiveTable();

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#ifdef TORCHMEM_PYTHON
// Sites, without the GIL.
//
// An allocation's site is read from the allocating thread's own Python stack, and the
// allocator never waits for the GIL to do so: PyTorch's bindings release it around every
// operator, and a thread that holds it may be waiting for a lock that the allocating
// thread's caller holds (the lock order behind pytorch#97833). So the walk uses no
// function of the Python C API that needs the GIL, touches no reference count, and
// allocates no Python object; what it learns is kept in C++ tables under sites_mutex, a
// lock under which nothing else is taken and no Python code runs.
//
// CPython invariants relied on:
// - PyGILState_GetThisThreadState() reads a thread-local: this thread's state, null for a
//   thread Python does not know (intra-op workers: their allocations get kNoPython).
// - A thread's frames change only in that thread: while it is here, inside a C function
//   its Python code called, its frames, and the code objects they hold, stay as they are.
// - The frames' layout is the interpreter's own: 3.11 to 3.13's internal pycore_frame.h,
//   which PyTorch's own C++ includes as this file does, and 3.10's public frame objects
//   (a Python of another version records no sites). torchmem_check_walk compares the walk
//   with the stack that sys._getframe shows, at load: a library that fails it records no
//   sites.
// - A code object's co_filename, co_name, co_qualname, co_firstlineno and line table never
//   change; a str is read through its immutable fields (PyUnicode_DATA); PyCode_Addr2Line
//   only reads. A code object is known in the cache by its address, checked against its
//   names and first line on each use: a new code object at a dead one's address, with
//   other names, is read anew.
// - While Python finalizes, the states of daemon threads are freed: no walk then.
constexpr int kUser = 0;  // the kinds of torchmem.records.frames, Match.lastindex of its rule
constexpr int kEngine = 1;
constexpr int kOther = 2;
constexpr int kLibrary = 3;

#if PY_VERSION_HEX >= 0x030B0000
using Frame = _PyInterpreterFrame;

inline Frame* innermost_frame(PyThreadState* state) {
#if PY_VERSION_HEX >= 0x030D0000
  return state->current_frame;
#else
  return state->cframe == nullptr ? nullptr : state->cframe->current_frame;
#endif
}
inline Frame* outer_frame(Frame* frame) { return frame->previous; }
inline PyCodeObject* code_of(Frame* frame) {
#if PY_VERSION_HEX >= 0x030D0000
  return reinterpret_cast<PyCodeObject*>(frame->f_executable);
#else
  return frame->f_code;
#endif
}
// A frame Python's own tracebacks pass over: one being set up, or the C stack's shim.
inline bool passed_over(Frame* frame) { return _PyFrame_IsIncomplete(frame); }
inline int offset_of(Frame* frame) { return _PyInterpreterFrame_LASTI(frame); }
inline int line_of(Frame* frame) {
  return PyCode_Addr2Line(code_of(frame), offset_of(frame) * static_cast<int>(sizeof(_Py_CODEUNIT)));
}
#else
using Frame = PyFrameObject;  // 3.10: the frames are frame objects, public

inline Frame* innermost_frame(PyThreadState* state) { return state->frame; }
inline Frame* outer_frame(Frame* frame) { return frame->f_back; }
inline PyCodeObject* code_of(Frame* frame) { return frame->f_code; }
inline bool passed_over(Frame*) { return false; }
inline int offset_of(Frame* frame) { return frame->f_lasti; }
inline int line_of(Frame* frame) { return PyFrame_GetLineNumber(frame); }
#endif

inline bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// What the cache knows of a code object; `kind` is -1 until the rule read it.
struct CodeInfo {
  PyObject* file;
  PyObject* name;
  PyObject* function;  // co_qualname from 3.11 on, else co_name
  int first_line;
  int kind;
  int32_t file_id;
  int32_t function_id;
  // The lines of the latest instruction offsets asked (offset -1: none): a line is read
  // from the code's line table by a scan from its start, and a loop allocates again and
  // again from the same few instructions.
  int offsets[4] = {-1, -1, -1, -1};
  int lines[4] = {0, 0, 0, 0};
  int next = 0;

  int line_at(Frame* frame) {
    const int offset = offset_of(frame);
    for (int i = 0; i < 4; ++i) {
      if (offsets[i] == offset) {
        return lines[i];
      }
    }
    const int line = line_of(frame);
    offsets[next] = offset;
    lines[next] = line;
    next = (next + 1) % 4;
    return line;
  }
};
// A frame of a site's stack: texts by their number in `texts`.
struct SiteFrame {
  int32_t file;
  int32_t function;
  int32_t line;
  bool operator==(const SiteFrame& other) const {
    return file == other.file && function == other.function && line == other.line;
  }
};
struct SiteHash {
  size_t operator()(const SiteFrame& key) const {
    return (static_cast<size_t>(key.file) * 1000003u ^ static_cast<size_t>(key.function)) *
               31u +
           static_cast<size_t>(key.line);
  }
};
// An allocation's stack as the walk read it: its frames, innermost first, and the place of
// the one that names its site.
struct Walked {
  std::vector<SiteFrame> frames;
  size_t chosen = 0;
  bool operator==(const Walked& other) const {
    return chosen == other.chosen && frames == other.frames;
  }
};
struct WalkedHash {
  size_t operator()(const Walked& key) const {
    size_t hash = key.chosen;
    for (const SiteFrame& frame : key.frames) {
      hash = hash * 1000003u ^ SiteHash{}(frame);
    }
    return hash;
  }
};

// torchmem.records.frames.pattern(), written out: that rule is a regular expression, and
// std::regex, which reads the C++ locale's facets, crashed while compiling it on one
// machine (GCC 13, Python 3.12, torch 2.11: in regex_traits::transform_primary, cause not
// established). The tests and torchmem_check_walk hold the two to the same answers.
struct Rule {
  std::vector<std::string> stdlib;     // frames.prefixes(frames.STDLIB)
  std::vector<std::string> installed;  // frames.prefixes(frames.INSTALLED)
};

std::mutex& sites_mutex = *new std::mutex();
// All of these under sites_mutex.
Rule* rule = nullptr;  // the rule's paths; none while no recording was started
std::unordered_map<PyObject*, CodeInfo>& code_infos = *new std::unordered_map<PyObject*, CodeInfo>();
std::vector<std::string>& texts = *new std::vector<std::string>();
std::unordered_map<std::string, int32_t>& text_ids = *new std::unordered_map<std::string, int32_t>();
// Each distinct stack once, by its index in the log's rows: a training loop's allocations
// come from a few hundred stacks, however many steps it runs.
std::unordered_map<Walked, int64_t, WalkedHash>& stack_ids =
    *new std::unordered_map<Walked, int64_t, WalkedHash>();
std::vector<const Walked*>& stacks = *new std::vector<const Walked*>();  // keys of stack_ids
std::vector<int>& site_kinds = *new std::vector<int>();  // the kind of each one's site
Walked& walked = *new Walked();  // the stack being read, its memory kept from walk to walk

// A str as UTF-8 (lone surrogates as U+FFFD), through its immutable fields only.
std::string utf8_of(PyObject* text) {
  std::string out;
  if (text == nullptr || !PyUnicode_Check(text)) {
    return out;
  }
#if PY_VERSION_HEX < 0x030C0000
  if (!PyUnicode_IS_READY(text)) {
    return out;
  }
#endif
  const int kind = PyUnicode_KIND(text);
  const void* data = PyUnicode_DATA(text);
  const Py_ssize_t n = PyUnicode_GET_LENGTH(text);
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_UCS4 c = PyUnicode_READ(kind, data, i);
    if (c >= 0xD800 && c <= 0xDFFF) {
      c = 0xFFFD;
    }
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if (c < 0x800) {
      out += static_cast<char>(0xC0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out += static_cast<char>(0xE0 | (c >> 12));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (c >> 18));
      out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    }
  }
  return out;
}

int32_t text_id(std::string text) {
  auto found = text_ids.find(text);
  if (found != text_ids.end()) {
    return found->second;
  }
  const auto id = static_cast<int32_t>(texts.size());
  texts.reserve(texts.size() + 1);
  text_ids.emplace(text, id);
  texts.push_back(std::move(text));
  return id;
}

// What the cache knows of `code`, read anew where it is new at its address. May throw
// std::bad_alloc.
CodeInfo& info_of(PyCodeObject* code) {
  PyObject* key = reinterpret_cast<PyObject*>(code);
#if PY_VERSION_HEX >= 0x030B0000
  PyObject* function = code->co_qualname;
#else
  PyObject* function = code->co_name;
#endif
  auto found = code_infos.find(key);
  if (found != code_infos.end()) {
    CodeInfo& known = found->second;
    if (known.file == code->co_filename && known.name == code->co_name &&
        known.function == function && known.first_line == code->co_firstlineno) {
      return known;
    }
    code_infos.erase(found);
  }
  CodeInfo info{code->co_filename, code->co_name, function, code->co_firstlineno, -1,
                text_id(utf8_of(code->co_filename)), text_id(utf8_of(function))};
  return code_infos.emplace(key, info).first->second;
}

inline bool separator(char c) { return c == '/' || c == '\\'; }

bool starts_with(const std::string& text, size_t at, const char* start) {
  return text.compare(at, std::strlen(start), start) == 0;
}

// (?!site-|dist-) at `at`.
bool no_packages_at(const std::string& file, size_t at) {
  return !starts_with(file, at, "site-") && !starts_with(file, at, "dist-");
}

// The components of `file` with a separator on each side, in order: a component's text
// starts one past a separator and ends at the next one.
std::vector<std::string> closed_components(const std::string& file, std::vector<size_t>& ends) {
  std::vector<std::string> found;
  size_t start = file.find_first_of("/\\");
  while (start != std::string::npos) {
    const size_t end = file.find_first_of("/\\", start + 1);
    if (end != std::string::npos) {
      found.push_back(file.substr(start + 1, end - start - 1));
      ends.push_back(end);
    }
    start = end;
  }
  return found;
}

bool is_python_version(const std::string& name) {  // (?:python|pypy)3\.\d+
  for (const char* start : {"python3.", "pypy3."}) {
    const size_t digits = std::strlen(start);
    if (name.size() > digits && name.compare(0, digits, start) == 0 &&
        std::all_of(name.begin() + static_cast<std::ptrdiff_t>(digits), name.end(),
                    [](char c) { return c >= '0' && c <= '9'; })) {
      return true;
    }
  }
  return false;
}

// What a frame of `file` running `function` is (no rule: kOther). In the order of the
// pattern's alternatives; each comment is the alternative it stands for.
int kind_by(const Rule* rule, const std::string& file, const std::string& function) {
  if (rule == nullptr) {
    return kOther;
  }
  std::vector<size_t> ends;
  const std::vector<std::string> parts = closed_components(file, ends);
  // [^\n]*[/\\]torch[/\\]autograd[/\\][^\n]*\n_engine_run_backward$
  if (function == "_engine_run_backward") {
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (parts[i] == "torch" && parts[i + 1] == "autograd") {
        return kEngine;
      }
    }
  }
  // each stdlib prefix, then (?!site-|dist-)
  for (const std::string& prefix : rule->stdlib) {
    if (starts_with(file, 0, prefix.c_str()) && no_packages_at(file, prefix.size())) {
      return kOther;
    }
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    // [^\n]*[/\\](?:torch|torchmem|torchinductor_[^/\\\n]*)[/\\]
    if (parts[i] == "torch" || parts[i] == "torchmem" || starts_with(parts[i], 0, "torchinductor_")) {
      return kOther;
    }
    // [^\n]*[/\\]lib[/\\](?:python|pypy)3\.\d+[/\\](?!site-|dist-)
    if (parts[i] == "lib" && i + 1 < parts.size() && is_python_version(parts[i + 1]) &&
        no_packages_at(file, ends[i + 1] + 1)) {
      return kOther;
    }
  }
  // [^\n]*\\Lib\\(?!site-)
  for (size_t at = file.find("\\Lib\\"); at != std::string::npos; at = file.find("\\Lib\\", at + 1)) {
    if (!starts_with(file, at + 5, "site-")) {
      return kOther;
    }
  }
  // <(?:frozen |eval_with_key>|string>)
  if (starts_with(file, 0, "<frozen ") || starts_with(file, 0, "<eval_with_key>") ||
      starts_with(file, 0, "<string>")) {
    return kOther;
  }
  // each installed prefix
  for (const std::string& prefix : rule->installed) {
    if (starts_with(file, 0, prefix.c_str())) {
      return kLibrary;
    }
  }
  // [^\n]*[/\\](?:site|dist)-packages[/\\]
  for (const std::string& part : parts) {
    if (part == "site-packages" || part == "dist-packages") {
      return kLibrary;
    }
  }
  return kUser;
}

// What a code object is, by the rule on its co_filename and co_name.
int kind_of(PyCodeObject* code, CodeInfo& info) {
  if (info.kind < 0) {
    info.kind = kind_by(rule, texts[static_cast<size_t>(info.file_id)], utf8_of(code->co_name));
  }
  return info.kind;
}

SiteFrame site_frame_of(Frame* frame, CodeInfo& info) {
  return {info.file_id, info.function_id, info.line_at(frame)};
}

SiteFrame site_frame_of(Frame* frame) { return site_frame_of(frame, info_of(code_of(frame))); }

// Room for one more element, growing by doubling: the push_back that follows cannot throw.
// May throw std::bad_alloc (before anything changed).
template <typename T>
void room_for_one(std::vector<T>& items) {
  if (items.size() == items.capacity()) {
    items.reserve(std::max<size_t>(64, 2 * items.capacity()));
  }
}

// The index of this allocation's stack, read into `walked`: its frames, and the site among
// them: walking out from the innermost frame, the first of the user's code or of autograd
// engine's entry point, else the first of an installed package, else the first
// (torchmem.records.frames.choose). A new stack is kept.
int64_t python_site() noexcept {
  if (!Py_IsInitialized() || finalizing()) {
    return kNoPython;
  }
  PyThreadState* state = PyGILState_GetThisThreadState();
  if (state == nullptr) {
    return kNoPython;
  }
  std::lock_guard<std::mutex> lock(sites_mutex);
  try {
    constexpr size_t kNone = ~size_t{0};
    size_t chosen = kNone;
    size_t library = kNone;
    int kind = kOther;  // the chosen frame's
    int innermost_kind = kOther;
    walked.frames.clear();
    for (Frame* frame = innermost_frame(state); frame != nullptr; frame = outer_frame(frame)) {
      if (passed_over(frame)) {
        continue;
      }
      PyCodeObject* code = code_of(frame);
      CodeInfo& info = info_of(code);
      if (chosen == kNone) {
        const int found = kind_of(code, info);
        if (walked.frames.empty()) {
          innermost_kind = found;
        }
        if (found == kUser || found == kEngine) {
          chosen = walked.frames.size();
          kind = found;
        } else if (found == kLibrary && library == kNone) {
          library = walked.frames.size();
        }
      }
      walked.frames.push_back(site_frame_of(frame, info));
    }
    if (walked.frames.empty()) {
      return kNoFrame;
    }
    if (chosen == kNone) {
      chosen = library != kNone ? library : 0;
      kind = library != kNone ? kLibrary : innermost_kind;
    }
    walked.chosen = chosen;
    auto found = stack_ids.find(walked);
    if (found != stack_ids.end()) {
      return found->second;
    }
    const auto id = static_cast<int64_t>(stacks.size());
    room_for_one(stacks);
    room_for_one(site_kinds);
    const Walked& kept = stack_ids.emplace(walked, id).first->first;
    stacks.push_back(&kept);
    site_kinds.push_back(kind);
    return id;
  } catch (...) {  // std::bad_alloc: this allocation has no site
    return kNoFrame;
  }
}

// The lines of `joined`, one path each (none for null).
std::vector<std::string> lines_of(const char* joined) {
  std::vector<std::string> found;
  const std::string text = joined == nullptr ? "" : joined;
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = std::min(text.find('\n', start), text.size());
    if (end > start) {
      found.push_back(text.substr(start, end - start));
    }
    start = end + 1;
  }
  return found;
}

// Forgets every site; from now on code objects are read by the rule with these paths
// ('\n'-separated: frames.prefixes of frames.STDLIB and of frames.INSTALLED), or by no
// rule where `stdlib` is null. Throws std::bad_alloc (before anything changed).
void reset_sites(const char* stdlib, const char* installed) {
  Rule* paths = stdlib == nullptr ? nullptr : new Rule{lines_of(stdlib), lines_of(installed)};
  std::lock_guard<std::mutex> lock(sites_mutex);
  delete rule;
  rule = paths;
  code_infos.clear();
  texts.clear();
  text_ids.clear();
  stacks.clear();
  stack_ids.clear();
  site_kinds.clear();
  std::vector<SiteFrame>().swap(walked.frames);
}
// Takes (true) or gives back the sites' lock, across a fork.
void lock_sites(bool take) {
  if (take) {
    sites_mutex.lock();
  } else {
    sites_mutex.unlock();
  }
}
#else
int64_t python_site() noexcept { return kNoSite; }
void lock_sites(bool) {}
#endif

// Room for one more row, or false (the row is dropped, and counted). Grows the log by
// doubling, as push_back would, but before anything else changed: the push_back that
// follows cannot throw. With log_mutex held.
bool room_for_a_row() noexcept {
  if (events.size() < events.capacity()) {
    return true;
  }
  try {
    events.reserve(std::max<size_t>(64, 2 * events.capacity()));
    return true;
  } catch (...) {  // std::bad_alloc
    dropped_rows.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
}

// Logs an allocation. Never throws (it runs inside allocate(), after the counters): a row
// that finds no memory (for itself or its entry in `live`) is dropped and counted. Its free
// then names no allocation, as a free of a storage made before the recording does.
void record_alloc(void* data, int64_t n) noexcept {
  const int64_t site = recording.load(std::memory_order_relaxed) == 2 ? python_site() : kNoSite;
  std::lock_guard<std::mutex> lock(log_mutex);
  if (!recording.load(std::memory_order_relaxed) || !room_for_a_row()) {
    return;
  }
  const int64_t seq = taken + static_cast<int64_t>(events.size());
  if (!live.put(data, Live{seq, kOtherCategory, generation})) {
    dropped_rows.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  events.push_back({now_ns(), reinterpret_cast<int64_t>(data), n, site, -1, kAlloc});
}

// Logs a free. Never throws (it runs inside a deleter): a row that finds no memory is
// dropped and counted.
void record_free(void* data, int64_t n) noexcept {
  std::lock_guard<std::mutex> lock(log_mutex);
  if (!recording.load(std::memory_order_relaxed)) {
    return;
  }
  int64_t ref = -1;
  Live* found = live.find(data);
  if (found != nullptr) {
    ref = found->seq;
    live.erase(found);
  }
  if (room_for_a_row()) {
    events.push_back({now_ns(), reinterpret_cast<int64_t>(data), -n, kNoSite, ref, kFree});
  }
}

// The peak: every read-modify-write of it is a compare-exchange that only raises it, so a
// raise never overwrites a higher one made at once in another thread. `current` and `peak`
// use sequentially consistent operations (on x86 they cost what relaxed ones do, but for
// the reset's stores), which torchmem_reset_peak needs.
inline void raise_peak(int64_t value) noexcept {
  int64_t peak = counters.peak.load();
  while (value > peak && !counters.peak.compare_exchange_weak(peak, value)) {
  }
}

inline void grow(int64_t n) noexcept { raise_peak(counters.current.fetch_add(n) + n); }

inline void shrink(int64_t n) noexcept {
  // The bytes before this free raise the peak too: where a reset stored a `current` that a
  // grow in another thread had just passed, the grow's own raise came before the store,
  // and the peak is below what was in use. Almost always a load and a compare.
  raise_peak(counters.current.fetch_sub(n));
  counters.freed.fetch_add(n, std::memory_order_relaxed);
  counters.frees.fetch_add(1, std::memory_order_relaxed);
}

// Counts a block of n bytes at data off, and logs it. Never throws.
void count_free(void* data, int64_t n) noexcept {
  shrink(n);
  if (recording.load(std::memory_order_relaxed)) {
    record_free(data, n);
  }
  try {
    c10::profiledCPUMemoryReporter().Delete(data);
  } catch (...) {  // the profiler's bookkeeping: the profiler misses one free
  }
}

// The deleter of a paged block (see "Paged blocks").
void delete_paged(void* data) noexcept {
  count_free(data, forget_paged(data));
  c10::free_cpu(data);
}

// The deleter of a block with a header, and the raw deleter: it frees a paged block too,
// which raw_deallocate hands it by its pointer alone. A paged block's data is page-aligned,
// and a block with a header seldom has its data there: only those look in the table.
void delete_counted(void* data) noexcept {
  if (data == nullptr) {
    return;
  }
  const size_t page = paged_alignment.load(std::memory_order_relaxed);
  if (page != 0 && reinterpret_cast<uintptr_t>(data) % page == 0) {
    const int64_t n = forget_paged(data);
    if (n != 0) {
      count_free(data, n);
      c10::free_cpu(data);
      return;
    }
  }
  char* block = static_cast<char*>(data) - kHeader;
  count_free(data, *reinterpret_cast<int64_t*>(block));
  c10::free_cpu(block);
}

void delete_adopted(void* data) noexcept {
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
    if (recording.load(std::memory_order_relaxed)) {
      record_free(data, n);
    }
  }
  try {
    default_deleter(data);  // c10's: the profiler's bookkeeping, then c10::free_cpu
  } catch (...) {  // the profiler's bookkeeping threw before the block was freed: it leaks
  }
}

struct CountingAllocator final : c10::Allocator {
  // Either fails whole, throwing what c10 throws, with nothing counted and the block given
  // back; or succeeds, and nothing after the block is remembered and reported can throw.
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return {nullptr, nullptr, &delete_counted, cpu};
    }
    const bool page = paged(n);
    const size_t asked = page ? n : n + kHeader;
    void* block = nullptr;
    try {
      block = c10::alloc_cpu(asked);
    } catch (c10::Error& error) {
      c10::profiledCPUMemoryReporter().OutOfMemory(n);
      // c10's message names the size asked of it: name the caller's instead (in a plain
      // c10::Error only; a subclass is rethrown as it is, keeping its Python type).
      std::string message = error.msg();
      const std::string size = std::to_string(asked);
      const size_t at = message.find(size);
      if (asked == n || at == std::string::npos || typeid(error) != typeid(c10::Error)) {
        throw;
      }
      message.replace(at, size.size(), std::to_string(n));
      throw c10::Error(message, error.backtrace(), error.caller());
    }
    void* data = page ? block : static_cast<char*>(block) + kHeader;
    try {
      if (page) {
        std::lock_guard<std::mutex> lock(paged_mutex);
        paged_sizes.emplace(data, static_cast<int64_t>(n));
      } else {
        *static_cast<int64_t*>(block) = static_cast<int64_t>(n);
      }
      c10::profiledCPUMemoryReporter().New(data, n);  // its table may throw std::bad_alloc
    } catch (...) {
      if (page) {
        forget_paged(data);
      }
      c10::free_cpu(block);
      throw;
    }
    if (page && paged_alignment.load(std::memory_order_relaxed) == 0) {
      paged_alignment.store(c10_alignment(n), std::memory_order_relaxed);
    }
    counters.allocated.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
    counters.allocations.fetch_add(1, std::memory_order_relaxed);
    grow(static_cast<int64_t>(n));
    if (recording.load(std::memory_order_relaxed)) {
      record_alloc(data, static_cast<int64_t>(n));
    }
    return {data, data, page ? &delete_paged : &delete_counted, cpu};
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
//
// Returns 2 where the default allocator is not c10::DefaultCPUAllocator (a build of
// PyTorch that torchmem does not know: its virtual table is not replaced), 3 where it
// does not allocate as this file assumes (see "What this file relies on").
int torchmem_install() {
  c10::Allocator* standard = c10::GetDefaultCPUAllocator();
  if (c10::GetCPUAllocator() != standard) {
    return 1;
  }
  if (allocator == nullptr) {
    // c10::DefaultCPUAllocator, as the Itanium C++ ABI names it (c10 does not declare it).
    if (std::strcmp(typeid(*standard).name(), "N3c1019DefaultCPUAllocatorE") != 0) {
      return 2;
    }
    if (c10_alignment(1) != c10::gAlignment) {
      return 3;  // the library's gAlignment is not this file's
    }
    {
      c10::DataPtr probe = standard->allocate(c10::gAlignment);
      if (probe.get() == nullptr || probe.get_context() != probe.get() ||
          probe.get_deleter() != standard->raw_deleter() ||
          reinterpret_cast<uintptr_t>(probe.get()) % c10::gAlignment != 0) {
        return 3;
      }
    }
    default_deleter = standard->raw_deleter();
    std::memcpy(&standard_vtable, static_cast<void*>(standard), sizeof(void*));
    // The adopted and paged sizes', the log's and the sites' locks must be free in a child
    // made by fork (DataLoader's workers): hold them across fork so that no other thread
    // holds one then. No thread takes another lock while it holds sites_mutex.
    pthread_atfork(
        [] {
          adopted_mutex.lock();
          paged_mutex.lock();
          log_mutex.lock();
          lock_sites(true);
        },
        [] {
          lock_sites(false);
          log_mutex.unlock();
          paged_mutex.unlock();
          adopted_mutex.unlock();
        },
        [] {
          // A child (a DataLoader worker) does not record: its log would only grow.
          recording.store(0);
          std::vector<Event>().swap(events);
          live.clear();
          taken = 0;
          lock_sites(false);
          log_mutex.unlock();
          paged_mutex.unlock();
          adopted_mutex.unlock();
        });
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

// Rows the log had no memory for since install (see dropped_rows), as an int64 that
// Python reads directly.
int64_t* torchmem_dropped_rows() { return reinterpret_cast<int64_t*>(&dropped_rows); }

// Restarts the peak at the current bytes. The store alone could go below what is in use:
// a grow in another thread between the load and the store compared itself with the old
// peak, and its raise was overwritten. The raise after the store takes `current` again;
// a free that follows raises the peak to the bytes before it (see shrink); later grows
// raise it themselves. So from here on the peak is never below `current`, and never above
// the most that was in use since this call began.
void torchmem_reset_peak() {
  counters.peak.store(counters.current.load());
  raise_peak(counters.current.load());
}

// Adopts a CPU storage made by the default allocator before install (a c10::StorageImpl*,
// which Python's UntypedStorage._cdata is): counts its bytes now and off when it dies.
// Returns the bytes adopted, 0 for a storage that is counted already or not the default
// allocator's; never throws.
//
// Call with the GIL held (ctypes.PyDLL), and a Python reference to the storage: it reads
// and swaps the storage's DataPtr, which is no atomic object. The reference keeps the
// storage alive; the GIL keeps every Python thread from starting what would change its
// DataPtr meanwhile (resize_, set_), since operators are started from Python code; one
// that another thread started before, still running without the GIL on this very storage,
// is not kept out (nor is its tensor's use safe in PyTorch then). Taking adopted_mutex with
// the GIL held cannot deadlock: no thread waits for the GIL holding it.
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
    // The size is in the table before delete_adopted can be the deleter: where the table
    // has no memory for it, the storage is left as it was (not counted).
    bool inserted = false;
    try {
      inserted = adopted_sizes.try_emplace(data, n).second;
    } catch (...) {  // std::bad_alloc
      return 0;
    }
    if (!inserted) {
      return 0;  // adopted already
    }
    if (!ptr.compare_exchange_deleter(default_deleter, &delete_adopted)) {
      adopted_sizes.erase(data);
      return 0;
    }
  }
  counters.adopted.fetch_add(n, std::memory_order_relaxed);
  grow(n);
  return n;
}

// Allocates and frees `n` bytes through PyTorch's CPU allocator, as a DataPtr and through
// the raw interface, and checks that the counters saw each, and that the data keeps c10's
// alignment. Returns 0 when they did.
int torchmem_self_test(int64_t n) {
  if (allocator == nullptr || c10::GetCPUAllocator() != allocator) {
    return 1;
  }
  int64_t allocated = counters.allocated.load();
  int64_t freed = counters.freed.load();
  {
    c10::DataPtr ptr = c10::GetCPUAllocator()->allocate(static_cast<size_t>(n));
    if (counters.allocated.load() - allocated < n || ptr.get_deleter() != &delete_counted ||
        reinterpret_cast<uintptr_t>(ptr.get()) % c10::gAlignment != 0) {
      return 2;
    }
  }
  if (counters.freed.load() - freed < n) {
    return 3;
  }
  allocated = counters.allocated.load();
  freed = counters.freed.load();
  c10::GetCPUAllocator()->raw_deallocate(c10::GetCPUAllocator()->raw_allocate(n));
  return counters.allocated.load() - allocated < n || counters.freed.load() - freed < n ? 4 : 0;
}

// Starts a recording: clears the log and, with sites != 0, records each allocation's site,
// telling code objects apart by the rule with these paths (see reset_sites). Returns 0, or
// 1 where there was no memory (nothing started).
int torchmem_record_start(int with_sites, const char* stdlib, const char* installed) {
#ifdef TORCHMEM_PYTHON
  try {
    reset_sites(stdlib, installed);
  } catch (...) {
    return 1;
  }
#else
  (void)stdlib;
  (void)installed;
  with_sites = 0;
#endif
  std::lock_guard<std::mutex> lock(log_mutex);
  events.clear();
  live.clear();
  taken = 0;
  ++generation;
  recording.store(with_sites ? 2 : 1);
  return 0;
}

// Stops recording; returns the sequence number after the last row.
int64_t torchmem_record_stop() {
  recording.store(0);
  std::lock_guard<std::mutex> lock(log_mutex);
  live.clear();
  return taken + static_cast<int64_t>(events.size());
}

// A recording starts inside the one going on: marks are logged anew. Returns the sequence
// number of its first row.
int64_t torchmem_record_nest() {
  std::lock_guard<std::mutex> lock(log_mutex);
  ++generation;
  return taken + static_cast<int64_t>(events.size());
}

// The sequence number of the next row, the recording going on (a recording inside
// another starts and ends at such numbers).
int64_t torchmem_record_count() {
  std::lock_guard<std::mutex> lock(log_mutex);
  return taken + static_cast<int64_t>(events.size());
}

// Records each allocation's site from now on, if the running recording does not already.
void torchmem_record_sites() {
#ifdef TORCHMEM_PYTHON
  int expected = 1;
  recording.compare_exchange_strong(expected, 2);
#endif
}

// Moves up to n of the oldest rows (six int64 each) to out; returns how many it moved.
int64_t torchmem_record_take(int64_t* out, int64_t n) {
  std::lock_guard<std::mutex> lock(log_mutex);
  const int64_t count = std::min(std::max<int64_t>(n, 0), static_cast<int64_t>(events.size()));
  std::memcpy(out, events.data(), static_cast<size_t>(count) * sizeof(Event));
  events.erase(events.begin(), events.begin() + count);
  if (events.empty() && events.capacity() > kKeptCapacity) {
    std::vector<Event>().swap(events);  // a backlog's memory goes back once drained
  }
  taken += count;
  return count;
}

// A mark: the storage at ptr is of `category` now. Returns the sequence number of its
// allocation (or adoption) where that lowers the category it had since the latest
// recording started (the caller then notes the mark with torchmem_record_note); -1 for a
// storage known as such already; -2 for one the log has not seen (made before it started:
// the caller may adopt it, torchmem_record_adopt).
int64_t torchmem_record_mark(void* ptr, int64_t category) {
  std::lock_guard<std::mutex> lock(log_mutex);
  Live* found = live.find(ptr);
  if (!recording.load(std::memory_order_relaxed)) {
    return -1;
  }
  if (found == nullptr) {
    return -2;
  }
  Live& storage = *found;
  if (storage.generation == generation && storage.category <= category) {
    return -1;
  }
  storage.category = category;
  storage.generation = generation;
  return storage.seq;
}

// Appends a row Python made (a mark, with its storage's size; a probe) to the log; one
// that finds no memory is dropped and counted (no C++ exception may reach ctypes).
void torchmem_record_note(int64_t kind, int64_t ptr, int64_t size, int64_t site, int64_t ref) {
  std::lock_guard<std::mutex> lock(log_mutex);
  if (recording.load(std::memory_order_relaxed) && room_for_a_row()) {
    events.push_back({now_ns(), ptr, size, site, ref, kind});
  }
}

// Adopts a storage made before the log started, alive still (its size from Python): a
// row that names it from now on. A row that finds no memory is dropped and counted.
void torchmem_record_adopt(void* ptr, int64_t size) {
  std::lock_guard<std::mutex> lock(log_mutex);
  if (!recording.load(std::memory_order_relaxed) || live.find(ptr) != nullptr ||
      !room_for_a_row()) {
    return;
  }
  const int64_t seq = taken + static_cast<int64_t>(events.size());
  if (!live.put(ptr, Live{seq, kOtherCategory, generation})) {
    dropped_rows.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  events.push_back({now_ns(), reinterpret_cast<int64_t>(ptr), size, kNoSite, seq, kAdopt});
}

// Whether sites can be recorded (built with Python's headers).
int torchmem_record_has_sites() {
#ifdef TORCHMEM_PYTHON
  return 1;
#else
  return 0;
#endif
}

#ifdef TORCHMEM_PYTHON
// (file, line, function) as a new tuple, texts decoded as Python decodes UTF-8.
static PyObject* frame_tuple(const std::string& file, int line, const std::string& function) {
  return Py_BuildValue("(s#is#)", file.data(), static_cast<Py_ssize_t>(file.size()), line,
                       function.data(), static_cast<Py_ssize_t>(function.size()));
}

// Stack i as a new (kind, frame, stack) tuple: the kind of torchmem.records.frames of the
// frame that names its site, that frame as (file, line, function), and the whole Python
// stack, as such frames, innermost first; None for no such stack. Call with the GIL held.
// What it reads is copied out under sites_mutex first: building Python objects can run a
// collection, whose finalizers may allocate.
PyObject* torchmem_record_site(int64_t i) {
  int kind = kOther;
  std::vector<std::tuple<std::string, int, std::string>> frames;
  try {
    std::lock_guard<std::mutex> lock(sites_mutex);
    if (i < 0 || i >= static_cast<int64_t>(stacks.size())) {
      Py_RETURN_NONE;
    }
    kind = site_kinds[static_cast<size_t>(i)];
    const auto text = [](int32_t id) { return texts[static_cast<size_t>(id)]; };
    const Walked& stack = *stacks[static_cast<size_t>(i)];
    const SiteFrame& site = stack.frames[stack.chosen];
    frames.emplace_back(text(site.file), site.line, text(site.function));
    for (const SiteFrame& frame : stack.frames) {
      frames.emplace_back(text(frame.file), frame.line, text(frame.function));
    }
  } catch (...) {
    return PyErr_NoMemory();
  }
  PyObject* stack = PyTuple_New(static_cast<Py_ssize_t>(frames.size() - 1));
  if (stack == nullptr) {
    return nullptr;
  }
  for (size_t k = 1; k < frames.size(); ++k) {
    PyObject* frame = frame_tuple(std::get<0>(frames[k]), std::get<1>(frames[k]),
                                  std::get<2>(frames[k]));
    if (frame == nullptr) {
      Py_DECREF(stack);
      return nullptr;
    }
    PyTuple_SET_ITEM(stack, static_cast<Py_ssize_t>(k - 1), frame);
  }
  PyObject* site = frame_tuple(std::get<0>(frames[0]), std::get<1>(frames[0]),
                               std::get<2>(frames[0]));
  if (site == nullptr) {
    Py_DECREF(stack);
    return nullptr;
  }
  return Py_BuildValue("(iNN)", kind, site, stack);
}

// The calling thread's Python stack as the walk reads it, a list of (file, line, function,
// kind by the rule with these paths) innermost first: torchmem compares it with
// sys._getframe's, and the kinds with the rule's in Python, at load. Call with the GIL held.
PyObject* torchmem_check_walk(const char* stdlib, const char* installed) {
  std::vector<std::tuple<std::string, int, std::string, int>> frames;
  try {
    const Rule paths{lines_of(stdlib), lines_of(installed)};
    std::lock_guard<std::mutex> lock(sites_mutex);
    PyThreadState* state = PyGILState_GetThisThreadState();
    for (Frame* frame = state ? innermost_frame(state) : nullptr; frame != nullptr;
         frame = outer_frame(frame)) {
      if (!passed_over(frame)) {
        const SiteFrame found = site_frame_of(frame);
        const std::string& file = texts[static_cast<size_t>(found.file)];
        frames.emplace_back(file, found.line, texts[static_cast<size_t>(found.function)],
                            kind_by(&paths, file, utf8_of(code_of(frame)->co_name)));
      }
    }
  } catch (...) {
    return PyErr_NoMemory();
  }
  PyObject* out = PyList_New(0);
  for (const auto& [file, line, function, kind] : frames) {
    PyObject* frame = out ? Py_BuildValue("(s#is#i)", file.data(),
                                          static_cast<Py_ssize_t>(file.size()), line,
                                          function.data(),
                                          static_cast<Py_ssize_t>(function.size()), kind)
                          : nullptr;
    if (frame == nullptr || PyList_Append(out, frame) < 0) {
      Py_XDECREF(frame);
      Py_XDECREF(out);
      return nullptr;
    }
    Py_DECREF(frame);
  }
  return out;
}
#endif

#ifdef TORCHMEM_PYTHON
// torchmem_record_mark, torchmem_record_note and torchmem_reset_peak as Python functions
// (vectorcall): the hooks call the first two a few hundred times a training step, the line
// profiler the third on every line that allocated, and a ctypes call costs ten times as
// much. Argument errors are Python's TypeError/OverflowError, never a C++ exception.
static PyObject* fast_mark(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "mark(ptr, category) takes 2 arguments");
    return nullptr;
  }
  void* ptr = PyLong_AsVoidPtr(args[0]);
  const long long category = PyLong_AsLongLong(args[1]);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  return PyLong_FromLongLong(torchmem_record_mark(ptr, category));
}

static PyObject* fast_note(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 5) {
    PyErr_SetString(PyExc_TypeError, "note(kind, ptr, size, site, ref) takes 5 arguments");
    return nullptr;
  }
  int64_t values[5];
  for (int k = 0; k < 5; ++k) {
    values[k] = PyLong_AsLongLong(args[k]);
  }
  if (PyErr_Occurred()) {
    return nullptr;
  }
  torchmem_record_note(values[0], values[1], values[2], values[3], values[4]);
  Py_RETURN_NONE;
}

static PyObject* fast_reset_peak(PyObject*, PyObject* const*, Py_ssize_t n) {
  if (n != 0) {
    PyErr_SetString(PyExc_TypeError, "reset_peak() takes no arguments");
    return nullptr;
  }
  torchmem_reset_peak();
  Py_RETURN_NONE;
}

static PyMethodDef fast_functions[] = {
    {"mark", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_mark)),
     METH_FASTCALL, "mark(ptr, category)"},
    {"note", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_note)),
     METH_FASTCALL, "note(kind, ptr, size, site, ref)"},
    {"reset_peak", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_reset_peak)),
     METH_FASTCALL, "reset_peak()"},
};

// (mark, note, reset_peak) as new Python function objects. Call with the GIL held.
PyObject* torchmem_record_functions() {
  return Py_BuildValue("(NNN)", PyCFunction_New(&fast_functions[0], nullptr),
                       PyCFunction_New(&fast_functions[1], nullptr),
                       PyCFunction_New(&fast_functions[2], nullptr));
}
#endif

// Storages the allocator did not make ------------------------------------------------
//
// Shared memory (a DataLoader worker's batch, share_memory_()), files mapped into memory
// (torch.from_file, torch.load(mmap=True)) and pinned memory come from other allocators
// (c10's MapAllocator, an accelerator's host allocator). torchmem.meters.storages sees each
// come into the process (it wraps the functions that make them, while something measures)
// and die (a finalizer on its Python storage, which PyTorch keeps alive as long as the
// storage lives, and which runs before the memory is unmapped): it counts them here, as
// allocations and frees of their own, in the counters and the log. Their deleters stay as
// they are: PyTorch finds a storage's MapAllocator from its deleter.

// Counts n bytes at data in, as an allocation, logged with the calling thread's site.
// Call with the GIL held (ctypes.PyDLL); never throws.
void torchmem_foreign_in(void* data, int64_t n) {
  if (n <= 0) {
    return;
  }
  counters.allocated.fetch_add(n, std::memory_order_relaxed);
  counters.allocations.fetch_add(1, std::memory_order_relaxed);
  grow(n);
  if (recording.load(std::memory_order_relaxed)) {
    record_alloc(data, n);
  }
}

// Counts off, as a free, the n bytes at data that torchmem_foreign_in counted. Never throws.
void torchmem_foreign_out(void* data, int64_t n) {
  if (n <= 0) {
    return;
  }
  shrink(n);
  if (recording.load(std::memory_order_relaxed)) {
    record_free(data, n);
  }
}

// End of the storages the allocator did not make --------------------------------------

// Frees the log and the sites. Call with the GIL held, after torchmem_record_stop.
void torchmem_record_clear() {
  std::lock_guard<std::mutex> lock(log_mutex);
  std::vector<Event>().swap(events);
  live.clear();
  taken = 0;
#ifdef TORCHMEM_PYTHON
  reset_sites(nullptr, nullptr);  // no memory needed for no rule
#endif
}

}  // extern "C"
