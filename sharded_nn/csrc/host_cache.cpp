// A caching CPU allocator for torch: large tensor buffers are kept when freed and handed to the
// next request of (nearly) the same size, instead of being unmapped and faulted in afresh.
//
// Why: a training or inference step allocates the same activation sizes every step. glibc either
// maps each large buffer afresh (page faults on every step: 4 KiB at a time, the dominant CPU
// cost of a sharded CNN or UNet forward on a VM) or keeps it in heap arenas where holes fragment
// and resident memory drifts above the live tensors. This allocator keeps whole mappings, reuses
// them by size, and bounds what it holds so that the process's mapped total never exceeds the
// peak of its live large buffers (plus a sixteenth, at most an eighth of the bytes that come and
// go: weights that stay live widen no slack): resident memory follows the live tensors as
// with a low mmap threshold, without the faults. At the bound, a request with no cached block of
// its size is served from cached pages: a larger block is cut (the rest stays cached), or the
// pages of smaller ones are moved side by side into one range by mremap (page tables move;
// nothing is copied or faulted in). Nothing is given back to the kernel in a steady step: on a
// VM that reports free pages to its host (virtio free page reporting), memory given back and
// mapped again is faulted in at the host too, 50-100x slower than a reuse here.
//
// Loaded by sharded_nn/host_cache.py through ctypes (plain C entry points, no Python API), and
// installed with c10::SetCPUAllocator. Buffers below `min_bytes` go to c10's own allocator.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // mremap
#endif
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHuge = size_t(2) << 20;
// Blocks up to this size are handed out most recently freed first (see file_free).
constexpr size_t kHotBytes = size_t(4) << 20;

struct Block {
  size_t size;  // mapped bytes (page multiple), starting at the key pointer
  // Lengths of the consecutive pieces it is made of, each within one kernel mapping (mremap
  // moves one mapping at a time): one for a block mapped whole, more for one joined from
  // cached blocks.
  std::vector<size_t> segs;
  std::list<void*>::iterator lru;  // position in `free_order_` while cached
};

class HostCache final : public c10::Allocator {
 public:
  HostCache(c10::Allocator* fallback, size_t min_bytes, bool huge_pages)
      : fallback_(fallback),
        fallback_deleter_(fallback->raw_deleter()),
        min_bytes_(min_bytes),
        huge_pages_(huge_pages) {
    TORCH_CHECK(fallback_deleter_ != nullptr, "sharded_nn host cache: torch's CPU allocator has no raw deleter");
  }

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < min_bytes_) {
      return fallback_->allocate(nbytes);
    }
    void* p = take(nbytes);
    return {p, p, &HostCache::deleter, c10::Device(c10::DeviceType::CPU)};
  }

  // Raw users (oneDNN's scratch buffers go through raw_allocate / raw_deallocate, looking the
  // allocator up on each call) may free through us a pointer the fallback allocated, before or
  // after the install: the deleter hands anything it did not map to the fallback's.
  c10::DeleterFnPtr raw_deleter() const override {
    return &HostCache::deleter;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  static void deleter(void* p);

  void give_back(void* p) {
    std::unique_lock<std::mutex> g(mu_);
    auto it = blocks_.find(p);
    if (it == blocks_.end()) {
      g.unlock();
      fallback_deleter_(p);
      return;
    }
    live_ -= it->second.size;
    note_live();
    if (it->second.segs.size() > kRefreshSegs) {
      // Joined and cut over many steps: unmapped, so that a fresh mapping of one piece (and
      // whole huge pages) replaces it, and no block's kernel mappings grow without bound.
      size_t size = it->second.size;
      blocks_.erase(it);
      ++evictions_;
      munmap(p, size);
      return;
    }
    cached_ += it->second.size;
    file_free(it->second.size, p);
    free_order_.push_back(p);
    it->second.lru = std::prev(free_order_.end());
  }

  void empty() {
    std::lock_guard<std::mutex> g(mu_);
    while (!free_order_.empty()) {
      evict_oldest();
    }
  }

  // fork() while another thread holds the lock would leave the child's copy locked forever (a
  // DataLoader worker started by fork): hold it across the fork, release it on both sides.
  void before_fork() {
    mu_.lock();
  }
  void after_fork() {
    mu_.unlock();
  }

  void stats(uint64_t* out) {
    std::lock_guard<std::mutex> g(mu_);
    out[0] = hits_;
    out[1] = misses_;
    out[2] = live_;
    out[3] = cached_;
    out[4] = peak_live_;
    out[5] = evictions_;
    out[6] = peak_mapped_;
    out[7] = reshapes_;
    out[8] = trough();
    uint64_t segs = 0;
    for (const auto& kv : blocks_) {
      segs += kv.second.segs.size();
    }
    out[9] = segs;
  }

 private:
  static size_t round_size(size_t n) {
    // Page multiple; above 1 MiB a 64 KiB multiple, so that sizes a few bytes apart (a slab one
    // row taller) share blocks.
    size_t g = n >= (size_t(1) << 20) ? (size_t(64) << 10) : kPage;
    return (n + g - 1) / g * g;
  }

  // The lowest live total over the last kWindow..2*kWindow releases (mu_ held; the live total's
  // minima all follow a release): what stays live across them (weights, optimizer state, the
  // input) is not counted in the slack.
  void note_live() {
    trough_now_ = std::min(trough_now_, live_);
    if (++releases_ % kWindow == 0) {
      trough_prev_ = trough_now_;
      trough_now_ = live_;
    }
  }
  size_t trough() const {
    return std::min(trough_prev_, trough_now_);
  }

  void* take(size_t nbytes) {
    size_t size = round_size(nbytes);
    {
      std::lock_guard<std::mutex> g(mu_);
      // Best fit among cached blocks, wasting at most an eighth of the request.
      auto it = free_by_size_.lower_bound(size);
      if (it != free_by_size_.end() && it->first <= size + size / 8) {
        void* p = it->second;
        uncache(it);
        ++hits_;
        return mark_live(p);
      }
      // A miss. Keep the mapped total (live + cached + new) within the peak of live bytes,
      // counting this request, plus a sixteenth of it, but at most an eighth of the bytes that
      // come and go (the peak above the recent trough): weights that stay live do not widen
      // the slack that a step's activations get (a ViT's 88 MiB beside 36 MiB of activations).
      size_t top = std::max(peak_live_, live_ + size);
      size_t budget = top + std::min(top / 16, (top - std::min(trough(), top)) / 8);
      if (!free_by_size_.empty() && (live_ + cached_ + size > budget || cached_ >= size)) {
        // Over the budget a cached block would be released anyway, and under it a new mapping
        // stays mapped until the budget releases some cached block later in the step: either
        // way, serve the request from cached pages when they suffice (a larger block is cut,
        // smaller ones are moved side by side). Reshaping only over the budget left a P=2
        // efficientnet_b0 2048x1024 forward with 8 misses and 623 page faults per step (P=1:
        // none; the slab sizes pair up less well), 2 and 96 with this.
        // Memory given back to the kernel and mapped again is faulted in afresh, and on a VM
        // that reports free pages to its host each such fault is a host fault too: a step
        // whose sizes do not pair up exactly refaulted part of its buffers on every step.
        void* q = it != free_by_size_.end() ? cut_cached(it, size) : join_cached(size, budget);
        if (q != nullptr) {
          ++reshapes_;
          return q;
        }
        while (!free_order_.empty() && live_ + cached_ + size > budget) {
          evict_oldest();
        }
      }
      ++misses_;
    }
    void* p = map(size);
    std::lock_guard<std::mutex> g(mu_);
    blocks_.emplace(p, Block{size, {size}, {}});
    return mark_live(p);
  }

  // Takes a cached block out of the cache (mu_ held); it stays in `blocks_`.
  void uncache(std::multimap<size_t, void*>::iterator it) {
    Block& b = blocks_.at(it->second);
    free_order_.erase(b.lru);
    cached_ -= b.size;
    free_by_size_.erase(it);
  }

  // The entry of cached block `p` in `free_by_size_` (mu_ held).
  std::multimap<size_t, void*>::iterator cached_entry(void* p) {
    auto it = free_by_size_.lower_bound(blocks_.at(p).size);
    while (it->second != p) {
      ++it;
    }
    return it;
  }

  // Files cached block `p` among the blocks of its size. Up to kHotBytes first, so that the next
  // request of that size takes the most recently freed one, whose lines are the likeliest still
  // in the core's caches (P=2 eval forwards at 512x256 and 1024x512 2-3% faster than handing out
  // the longest-idle one). Larger blocks last (the longest-idle first, as multimap::emplace
  // files them): no cache holds them, and taking the newest of them left more blocks idle long
  // enough to be reshaped and refaulted (efficientnet_b0 2048x1024 P=2 forward 2% slower).
  void file_free(size_t size, void* p) {  // mu_ held
    if (size <= kHotBytes) {
      free_by_size_.emplace_hint(free_by_size_.lower_bound(size), size, p);
    } else {
      free_by_size_.emplace(size, p);
    }
  }

  void cache(void* p) {  // mu_ held; p is in `blocks_`
    Block& b = blocks_.at(p);
    cached_ += b.size;
    file_free(b.size, p);
    free_order_.push_back(p);
    b.lru = std::prev(free_order_.end());
  }

  void* mark_live(void* p) {  // mu_ held
    live_ += blocks_.at(p).size;
    peak_live_ = std::max(peak_live_, live_);
    peak_mapped_ = std::max(peak_mapped_, live_ + cached_);
    return p;
  }

  // Cuts block `p` (not cached) to its first `head` bytes; the rest becomes a cached block of
  // its own, or is unmapped when smaller than the cache's threshold (mu_ held). No page moves.
  void cut(void* p, size_t head) {
    Block& b = blocks_.at(p);
    char* tail = static_cast<char*>(p) + head;
    size_t tail_size = b.size - head;
    std::vector<size_t> head_segs, tail_segs;
    size_t at = 0;
    for (size_t len : b.segs) {
      if (at + len <= head) {
        head_segs.push_back(len);
      } else if (at >= head) {
        tail_segs.push_back(len);
      } else {
        head_segs.push_back(head - at);
        tail_segs.push_back(at + len - head);
      }
      at += len;
    }
    b.size = head;
    b.segs = std::move(head_segs);
    if (tail_size < min_bytes_) {
      munmap(tail, tail_size);
      ++evictions_;
      return;
    }
    blocks_.emplace(tail, Block{tail_size, std::move(tail_segs), {}});
    cache(tail);
  }

  // The smallest cached block larger than the request, cut to it unless the rest is small (mu_ held).
  void* cut_cached(std::multimap<size_t, void*>::iterator it, size_t size) {
    void* p = it->second;
    uncache(it);
    size_t head = cut_point(p, size);
    // A tail below the cache's threshold would be unmapped, and the pages faulted in again by
    // the next request that needs them: a grouped conv's step (424 KiB freed, 368 KiB asked,
    // 424 KiB asked next step) remapped and faulted on every step, 1.45x slower. The block
    // goes out whole instead (its size stays counted live, so the budget sees it).
    if (blocks_.at(p).size - head >= min_bytes_) {
      cut(p, head);
    }
    return mark_live(p);
  }

  // Where to cut block `p` for a request of `size` (its hit tolerance allows up to an eighth
  // more): at a boundary between its pieces if one falls there (no new piece: cutting and
  // joining every step would otherwise split blocks into ever more pieces), else on a 2 MiB
  // address boundary (a huge page is not split), else at `size`.
  size_t cut_point(void* p, size_t size) {
    size_t limit = size + size / 8;
    size_t at = 0;
    for (size_t len : blocks_.at(p).segs) {
      at += len;
      if (at >= size && at <= limit && at < blocks_.at(p).size) {
        return at;
      }
    }
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    size_t huge = ((a + size + kHuge - 1) & ~(kHuge - 1)) - a;
    if (huge_pages_ && huge <= limit && huge < blocks_.at(p).size) {
      return huge;
    }
    return size;
  }

  // Every cached block is smaller than the request (mu_ held): a new address range of `size`
  // bytes (or a little more, see `extent`) takes the pages of the largest ones, moved there by
  // mremap (page tables move, nothing is faulted or copied; old contents stay, as with any
  // reused block); only the part they do not cover is faulted in later. Null when no range
  // could be reserved.
  void* join_cached(size_t size, size_t budget) {
    // The blocks to join, largest first; a block that would take the range past kMaxSegs pieces
    // (one mremap each, one kernel mapping each) is left in the cache.
    std::vector<void*> chosen;
    size_t total = 0, nsegs = 0;
    for (auto r = free_by_size_.rbegin(); r != free_by_size_.rend() && total < size; ++r) {
      size_t ns = blocks_.at(r->second).segs.size();
      if (nsegs + ns > kMaxSegs) {
        continue;
      }
      chosen.push_back(r->second);
      total += r->first;
      nsegs += ns;
    }
    // The last block would be cut to fit; a rest below the cache's threshold would be unmapped
    // (and faulted in again by a later step), so the range takes that block whole instead.
    size_t extent = total > size && total - size < min_bytes_ ? total : size;
    void* dst = map_raw(extent);
    if (dst == nullptr) {
      return nullptr;
    }
    std::vector<size_t> segs;
    size_t at = 0;
    for (void* p : chosen) {
      uncache(cached_entry(p));
      if (blocks_.at(p).size > extent - at) {
        cut(p, extent - at);
      }
      char* src = static_cast<char*>(p);
      for (size_t len : blocks_.at(p).segs) {
        char* to = static_cast<char*>(dst) + at;
        if (mremap(src, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, to) == MAP_FAILED) {
          munmap(src, len);  // `to` keeps the reserved pages: faulted in on first touch
        }
        segs.push_back(len);
        src += len;
        at += len;
      }
      blocks_.erase(p);
    }
    if (at < extent) {
      segs.push_back(extent - at);
    }
    blocks_.emplace(dst, Block{extent, std::move(segs), {}});
    live_ += extent;
    peak_live_ = std::max(peak_live_, live_);
    peak_mapped_ = std::max(peak_mapped_, live_ + cached_);  // the uncovered part adds to it
    while (!free_order_.empty() && live_ + cached_ > budget) {
      evict_oldest();
    }
    return dst;
  }

  void* map(size_t size) {  // mu_ not held
    void* p = map_raw(size);
    if (p == nullptr) {
      empty();
      p = map_raw(size);
      TORCH_CHECK(p != nullptr, "sharded_nn host cache: out of memory mapping ", size, " bytes");
    }
    return p;
  }

  // A fresh anonymous range (no pages yet), or null. Ranges of 2 MiB and more start on a 2 MiB
  // boundary and are offered transparent huge pages (as torch's THP_MEM_ALLOC_ENABLE does):
  // 512 times fewer first-touch faults.
  void* map_raw(size_t size) {
    bool huge = huge_pages_ && size >= kHuge;
    size_t span = huge ? size + kHuge : size;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      return nullptr;
    }
    if (!huge) {
      return raw;
    }
    uintptr_t a = reinterpret_cast<uintptr_t>(raw);
    uintptr_t start = (a + kHuge - 1) & ~(kHuge - 1);
    if (start > a) {
      munmap(raw, start - a);
    }
    size_t tail = (a + span) - (start + size);
    if (tail > 0) {
      munmap(reinterpret_cast<void*>(start + size), tail);
    }
    madvise(reinterpret_cast<void*>(start), size, MADV_HUGEPAGE);
    return reinterpret_cast<void*>(start);
  }

  void evict_oldest() {  // mu_ held
    void* p = free_order_.front();
    size_t size = blocks_.at(p).size;
    uncache(cached_entry(p));
    blocks_.erase(p);
    ++evictions_;
    munmap(p, size);
  }

  c10::Allocator* fallback_;
  c10::DeleterFnPtr fallback_deleter_;
  size_t min_bytes_;
  bool huge_pages_;
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;  // every block we mapped, live or cached
  std::multimap<size_t, void*> free_by_size_;  // cached blocks by size
  std::list<void*> free_order_;  // cached blocks, longest unused first
  static constexpr uint64_t kWindow = 1024;
  static constexpr size_t kMaxSegs = 64;
  static constexpr size_t kRefreshSegs = 32;
  size_t live_ = 0, cached_ = 0, peak_live_ = 0, peak_mapped_ = 0;
  size_t trough_now_ = SIZE_MAX, trough_prev_ = SIZE_MAX;  // no release yet: no slack
  uint64_t releases_ = 0;
  uint64_t hits_ = 0, misses_ = 0, evictions_ = 0, reshapes_ = 0;
};

HostCache* g_cache = nullptr;

void HostCache::deleter(void* p) {
  g_cache->give_back(p);
}

void before_fork() {
  g_cache->before_fork();
}
void after_fork() {
  g_cache->after_fork();
}

}  // namespace

extern "C" {

// Install the cache as torch's CPU allocator; 0 on success, 1 if one is installed already.
int snn_host_cache_install(uint64_t min_bytes, int huge_pages) {
  if (g_cache != nullptr) {
    return 1;
  }
  // Never freed: tensors allocated here may be released at any point until the process ends.
  g_cache = new HostCache(c10::GetCPUAllocator(), min_bytes, huge_pages != 0);
  pthread_atfork(&before_fork, &after_fork, &after_fork);
  c10::SetCPUAllocator(g_cache, /*priority=*/100);
  return 0;
}

// hits, misses, live bytes, cached bytes, peak live bytes, evictions, peak mapped bytes, reshapes,
// the recent trough of live bytes, the pieces all blocks are made of.
void snn_host_cache_stats(uint64_t* out) {
  if (g_cache == nullptr) {
    std::memset(out, 0, 10 * sizeof(uint64_t));
    return;
  }
  g_cache->stats(out);
}

void snn_host_cache_empty() {
  if (g_cache != nullptr) {
    g_cache->empty();
  }
}
}
