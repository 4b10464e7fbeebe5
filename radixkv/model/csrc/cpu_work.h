// Work items of the native attention kernels, run longest first on torch's intra-op threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace radixkv_work {

// Runs every item of `items` (each with an int64 `cost`): sorted longest first, taken from a
// shared counter by at most one worker per torch thread, so causal prefills (whose later blocks
// cost more) balance. Each worker makes its scratch once with `make_scratch()` and calls
// `run(item, scratch)` per item.
template <class Item, class MakeScratch, class Run>
void run_longest_first(std::vector<Item>& items, MakeScratch make_scratch, Run run) {
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      run(items[i], scratch);
    }
  });
}

}  // namespace radixkv_work
