// fp32 linear layers over weights pre-packed once into MKL's internal GEMM layout.
//
// torch's CPU build carries Intel MKL and exports its packed-GEMM entry points
// (cblas_sgemm_pack_get_size, cblas_sgemm_pack, cblas_sgemm_compute). Packing a weight once
// moves the per-call reordering of B out of every matmul: on small row counts (decode batches of
// a few to a few dozen sequences) this is 10-30% faster than at::linear. Built by
// cluster/packed_linear.py with torch.utils.cpp_extension; on a torch without these symbols the
// module fails to load and the plain path serves instead.
//
// The packed buffer's internals depend on its address ("do not copy the packed matrix to a
// different address", oneMKL reference), so callers keep the tensor where it was made.

#include <torch/extension.h>

#include <cstdint>

extern "C" {
// oneMKL's CBLAS prototypes (LP64: MKL_INT is int), declared here so no mkl.h is needed.
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float* src, int ld, float* dest);
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                         int lda, const float* b, int ldb, float beta, float* c, int ldc);
}

namespace pdserve {

// CBLAS enum values.
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;
constexpr int kPacked = 151;
constexpr int kBMatrix = 162;
// The row count the pack is tuned for; MKL accepts any m in compute (checked at load by
// cluster/packed_linear.py against at::linear).
constexpr int kRowsHint = 32;

int64_t packed_floats(int64_t n, int64_t k) {
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, kRowsHint, int(n), int(k));
  return int64_t((bytes + sizeof(float) - 1) / sizeof(float));
}

void check_dims(int64_t n, int64_t k) {
  TORCH_CHECK(n > 0 && k > 0 && n < (int64_t(1) << 31) && k < (int64_t(1) << 31),
              "packed_gemm: weight dims out of range: ", n, " x ", k);
}

// weight: [n, k] fp32 (nn.Linear's [out_features, in_features]) -> opaque packed buffer.
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kFloat32 &&
                  weight.dim() == 2,
              "packed_gemm: weight must be a 2-D fp32 CPU tensor");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  check_dims(n, k);
  auto packed = torch::empty({packed_floats(n, k)}, w.options());
  // B = W^T (k x n): W is row-major n x k, so op(src) = src^T with leading dimension k.
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, kRowsHint, int(n), int(k), 1.0f,
                   w.data_ptr<float>(), int(k), packed.data_ptr<float>());
  return packed;
}

// x: [m, k] fp32 -> x @ W^T (+ bias): [m, n], like at::linear(x, W, bias), W being the [n, k]
// weight `packed` was made from.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            int64_t k, const c10::optional<torch::Tensor>& bias) {
  check_dims(n, k);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.size(1) == k,
              "packed_gemm: input must be a 2-D fp32 CPU tensor of ", k, " columns, got ",
              x.sizes());
  const auto a = x.contiguous();
  const int64_t m = a.size(0);
  TORCH_CHECK(m < (int64_t(1) << 31), "packed_gemm: too many rows: ", m);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kFloat32 &&
                  packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() == packed_floats(n, k),
              "packed_gemm: packed buffer does not fit a ", n, " x ", k, " weight");
  torch::Tensor out;
  float beta = 0.0f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat32 &&
                    bias->dim() == 1 && bias->size(0) == n,
                "packed_gemm: bias must be an fp32 CPU tensor of ", n, " values");
    // C starts as a copy of the bias (clone: for one row, contiguous() would alias the bias
    // itself); beta = 1 adds the product.
    out = bias->expand({m, n}).clone(at::MemoryFormat::Contiguous);
    beta = 1.0f;
  } else {
    out = torch::empty({m, n}, a.options());
  }
  if (m == 0) return out;
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, int(m), int(n), int(k), a.data_ptr<float>(),
                      int(k), packed.data_ptr<float>(), int(k), beta, out.data_ptr<float>(),
                      int(n));
  return out;
}

}  // namespace pdserve

// Both run without the GIL, as torch's own ops do: the engine thread's GEMMs then overlap the
// replica's event loop instead of stalling it (and the loop's Python no longer stalls them).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("pack_weight", &pdserve::pack_weight, "pack an [n, k] fp32 weight for packed_linear",
        release());
  m.def("packed_linear", &pdserve::packed_linear, "x @ W^T (+ bias) over a packed weight",
        release());
}
