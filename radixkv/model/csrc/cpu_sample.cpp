// The sampler's draw for rows that filter nothing (temperature only): one pass over each row's
// logits instead of the five full-width torch ops (subtract, scale, exp, cumsum, search) and
// their temporaries.
//
//   sample_rows(logits [B, V] f32 or bf16, inv_temperature [B] f32, uniforms [B] f64) -> int64 [B]
//   argmax_rows(logits [B, V] f32 or bf16) -> int64 [B]: torch.argmax(logits, -1) exactly (the
//     first index of the row's largest value; the first NaN where the row has one), rows in
//     parallel
//
// bf16 logits are read as their float32 values (exact), so a bf16 row gives the token its float32
// copy would, without the copy (a batch-64 step's logits are 12.6 MB in float32).
//
// Row i: w_j = exp((x_j - max_i) * inv_temperature_i) (2^x by the float32 polynomial of
// cpu_vec.h; -inf logits weigh exactly 0), total = sum_j w_j, and the token is the first j whose
// cumulative weight exceeds uniforms_i * total: the same inverse-CDF rule as
// radixkv.engine.sampler.Sampler.draw, so it picks the same token for the same uniform except
// where uniforms_i * total falls within float rounding of a CDF boundary. Sums are float64 (per
// block of kBlock weights, then over blocks), so the search visits one block, not the row.
// A row with a NaN or +inf logit, or none above -inf, gets -1 (the caller tames such rows itself).

#include "cpu_sample.h"

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace radixkv_vec;

constexpr int64_t kBlock = 256;  // weights per partial sum (a multiple of VW)
constexpr float kLog2e = 1.4426950408889634f;

// The row's largest logit (NaNs skipped); *any_nan whether the row holds a NaN.
template <class E>
float row_max(const E* x, int64_t n, bool* any_nan) {
  int64_t j = 0;
  vf mv = splat(-INFINITY);
  vi nan{};
  for (; j + VW <= n; j += VW) {
    const vf v = loadv(x + j);
    mv = v > mv ? v : mv;
    nan |= v != v;
  }
  float m = -INFINITY;
  *any_nan = false;
  for (int i = 0; i < VW; ++i) {
    m = std::max(m, mv[i]);
    *any_nan |= nan[i] != 0;
  }
  for (; j < n; ++j) {
    const float v = loads(x + j);
    m = std::max(m, v);
    *any_nan |= std::isnan(v);
  }
  return m;
}

// Weights of x[0 .. n) into w, and the float64 sum of each block of kBlock into sums.
template <class E>
void weights(const E* x, int64_t n, float m, float c, float* w, double* sums) {
  const vf mv = splat(m), cv = splat(c);
  for (int64_t b0 = 0, k = 0; b0 < n; b0 += kBlock, ++k) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    int64_t j = b0;
    vf acc = splat(0.f);
    for (; j + VW <= b1; j += VW) {
      const vf e = exp2v((loadv(x + j) - mv) * cv);
      storev(w + j, e);
      acc += e;
    }
    double s = 0.0;
    for (int i = 0; i < VW; ++i) s += acc[i];
    for (; j < b1; ++j) {  // the row's tail, one at a time
      float arg = (loads(x + j) - m) * c;
      w[j] = arg < -126.f ? 0.f : std::exp2(arg);
      s += w[j];
    }
    sums[k] = s;
  }
}

int64_t draw(const float* w, const double* sums, int64_t n, double u) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t k = 0; k < blocks; ++k) total += sums[k];
  const double target = u * total;
  double acc = 0.0;
  for (int64_t k = 0; k < blocks; ++k) {
    if (acc + sums[k] <= target) {
      acc += sums[k];
      continue;
    }
    for (int64_t j = k * kBlock; j < std::min(n, (k + 1) * kBlock); ++j) {
      acc += w[j];
      if (acc > target) return j;
    }
  }
  // u * total rounded up to the total (or the block sums' order lost it): the last kept token
  for (int64_t j = n - 1; j > 0; --j) {
    if (w[j] > 0.f) return j;
  }
  return 0;
}

void check_logits(const at::Tensor& logits, const char* what) {
  TORCH_CHECK(logits.device().is_cpu() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.dim() == 2 && logits.is_contiguous(),
              what, ": logits must be a contiguous CPU float32 or bfloat16 [B, V] tensor");
  TORCH_CHECK(logits.size(1) > 0, what, ": empty vocabulary");
}

// Calls fn with the logits' data: float32, or bf16 as its bits (check_logits first).
template <class Fn>
void dispatch_logits(const at::Tensor& logits, Fn&& fn) {
  if (logits.scalar_type() == at::kFloat) {
    fn(logits.data_ptr<float>());
  } else {
    fn(reinterpret_cast<const uint16_t*>(logits.data_ptr()));
  }
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temperature,
                       const at::Tensor& uniforms) {
  check_logits(logits, "sample_rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(inv_temperature.scalar_type() == at::kFloat && inv_temperature.numel() == B &&
                  inv_temperature.is_contiguous(),
              "sample_rows: inv_temperature must be a contiguous float32 [B] tensor");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.numel() == B &&
                  uniforms.is_contiguous(),
              "sample_rows: uniforms must be a contiguous float64 [B] tensor");
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* inv_t = inv_temperature.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* tok = out.data_ptr<int64_t>();
  dispatch_logits(logits, [&](const auto* x) {
    at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> w(V);
      std::vector<double> sums((V + kBlock - 1) / kBlock);
      for (int64_t i = begin; i < end; ++i) {
        const auto* row = x + i * V;
        bool nan;
        const float m = row_max(row, V, &nan);
        if (nan || !std::isfinite(m)) {
          tok[i] = -1;
          continue;
        }
        weights(row, V, m, inv_t[i] * kLog2e, w.data(), sums.data());
        tok[i] = draw(w.data(), sums.data(), V, u[i]);
      }
    });
  });
  return out;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_logits(logits, "argmax_rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  int64_t* tok = out.data_ptr<int64_t>();
  dispatch_logits(logits, [&](const auto* x) {
    at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto* row = x + i * V;
        bool any_nan;  // one pass: the largest value (NaNs skipped), and whether a NaN is there
        const float m = row_max(row, V, &any_nan);
        // the first index holding it: whole blocks of 4 vectors tested at once, then one by one
        auto hit = [&](float v) { return any_nan ? std::isnan(v) : v == m; };
        const vf target = splat(m);
        int64_t c = 0;
        for (; c + 4 * VW <= V; c += 4 * VW) {
          vi any{};
          for (int u = 0; u < 4; ++u) {
            const vf v = loadv(row + c + u * VW);
            any |= any_nan ? (v != v) : (v == target);
          }
          bool found = false;
          for (int k = 0; k < VW; ++k) found |= any[k] != 0;
          if (found) break;
        }
        while (c < V - 1 && !hit(loads(row + c))) ++c;
        tok[i] = c;
      }
    });
  });
  return out;
}

// Grammar masks (radixkv/engine/grammar.py): for each r in rows, logits[r, j] = -inf wherever
// bit j of bitmask[r] is 0, in place (xgrammar's apply with indices). A bitmask row is ceil(V / 32) int32 words, bit b of word w standing
// for token 32 w + b (xgrammar's layout). A word of all ones is skipped, a word of zeros filled
// with vector stores, a mixed word walks its zero bits; rows run in parallel. This replaces
// xgrammar's CPU apply, which visits every element on one thread.
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask,
                          const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous(),
              "apply_token_bitmask_: logits must be a contiguous CPU float32 [B, V] tensor");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask_: bitmask must be a contiguous int32 [N, W] tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "apply_token_bitmask_: rows must be a contiguous int64 [n] tensor");
  const int64_t B = logits.size(0), V = logits.size(1), W = bitmask.size(1);
  TORCH_CHECK(W * 32 >= V, "apply_token_bitmask_: the bitmask is narrower than the vocabulary");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < B && r[i] < bitmask.size(0),
                "apply_token_bitmask_: a row is outside the logits or the bitmask");
  }
  float* x = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const vf neg = splat(-INFINITY);
  at::parallel_for(0, rows.numel(), 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = x + r[i] * V;
      const uint32_t* m = bits + r[i] * W;
      for (int64_t w = 0; w * 32 < V; ++w) {
        const uint32_t word = m[w];
        if (word == 0xffffffffu) continue;
        float* p = row + w * 32;
        if (word == 0u && (w + 1) * 32 <= V) {
          for (int k = 0; k < 32; k += VW) storev(p + k, neg);
          continue;
        }
        uint32_t off = ~word;  // the disallowed tokens of this word
        while (off != 0u) {
          const int b = __builtin_ctz(off);
          if (w * 32 + b >= V) break;
          p[b] = -INFINITY;
          off &= off - 1;
        }
      }
    }
  });
}
