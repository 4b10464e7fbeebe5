// Work items of the native attention kernels, run longest first on torch's intra-op threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace radixkv_work {

// How many workers share n output rows among `threads` when each takes whole units of `unit`
// rows: at most one per unit. So which rows a kernel multiplies together, and every output's
// arithmetic, does not depend on the thread count.
inline int64_t unit_workers(int64_t n, int64_t unit, int64_t threads) {
  return std::max<int64_t>(1, std::min<int64_t>(threads, (n + unit - 1) / unit));
}

// Worker `worker` of `workers`' output rows [first, second): whole units, in order.
inline std::pair<int64_t, int64_t> unit_rows(int64_t n, int64_t unit, int64_t worker,
                                             int64_t workers) {
  const int64_t units = (n + unit - 1) / unit;
  return {std::min(n, units * worker / workers * unit),
          std::min(n, units * (worker + 1) / workers * unit)};
}

// Runs every item of `items` (each with an int64 `cost`): sorted longest first, taken from a
// shared counter by at most one worker per torch thread, so causal prefills (whose later blocks
// cost more) balance. Each worker gets its scratch once from `make_scratch()` (a value, or a
// reference to one its thread keeps) and calls `run(item, scratch)` per item. While more than two items per worker are left, a worker
// takes its next item before running the current one and calls `prefetch(next, scratch)`
// first, so the next item's first memory is on its way while the current one computes (a
// decode's K/V pages come cold from DRAM after the linears).
template <class Item, class MakeScratch, class Run, class Prefetch>
void run_longest_first(std::vector<Item>& items, MakeScratch make_scratch, Run run,
                       Prefetch prefetch) {
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    decltype(auto) scratch = make_scratch();  // a value, or a reference to a reused one
    int64_t i = next.fetch_add(1);
    while (i < n_items) {
      // Take ahead only while many items are left: with few, and long, ones (a prefill's) a
      // reserved item could leave the other workers idle.
      int64_t j = n_items;
      if (n_items - i > 2 * workers) {
        j = next.fetch_add(1);
        if (j < n_items) prefetch(items[j], scratch);
      }
      run(items[i], scratch);
      i = j < n_items ? j : next.fetch_add(1);
    }
  });
}

// As above, with no prefetch.
template <class Item, class MakeScratch, class Run>
void run_longest_first(std::vector<Item>& items, MakeScratch make_scratch, Run run) {
  run_longest_first(items, make_scratch, run, [](const Item&, auto&) {});
}

}  // namespace radixkv_work
