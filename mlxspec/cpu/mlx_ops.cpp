// The host math of mlxspec.targets.host_math as MLX primitives: MLX's softmax (with the causal
// mask), its attention fallback around it, and mlx-lm's SwiGLU, computed by mlx_math.c (MLX's own
// arithmetic, 16 lanes) on MLX's CPU stream inside the graph. As Python callbacks they needed the
// graph evaluated up to them (a layer's graph cut in two, ~100-200 us here); as primitives they
// are ops like MLX's. Built by mlxspec.cpu_ops against the MLX wheel's headers and nanobind (the
// ABI MLX's own bindings use).
#include <nanobind/nanobind.h>

#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

extern "C" {
void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc);  // whichever MLX's calls reach
void mlxspec_softmax_rows(float *x, long rows, long n, long q_rows, long causal_from);
void mlxspec_swiglu(const float *g, const float *x, float *out, long n);
int mlxspec_math_lanes(void);
}

namespace {

// `in` as C-contiguous floats: its own buffer, or a copy gathered by its strides into `tmp`
const float *row_major(const mx::array &in, std::vector<float> &tmp) {
    if (in.flags().row_contiguous) return in.data<float>();
    tmp.resize(in.size());
    const float *src = in.data<float>();
    int nd = in.ndim();
    std::vector<int> idx(nd, 0);
    for (size_t i = 0; i < in.size(); i++) {
        int64_t off = 0;
        for (int d = 0; d < nd; d++) off += (int64_t)idx[d] * in.strides()[d];
        tmp[i] = src[off];
        for (int d = nd - 1; d >= 0; d--) {
            if (++idx[d] < in.shape(d)) break;
            idx[d] = 0;
        }
    }
    return tmp.data();
}

// A primitive's eval_cpu: `out` allocated, then f(inputs, out) run on the CPU stream `s` after the
// work that produces the inputs (MLX's own CPU primitives dispatch the same way)
template <class F>
void dispatch(mx::Stream s, const std::vector<mx::array> &inputs, mx::array &out, F f) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &enc = mx::cpu::get_command_encoder(s);
    std::vector<mx::array> in;
    for (auto &a : inputs) {
        enc.set_input_array(a);
        in.push_back(mx::array::unsafe_weak_copy(a));
    }
    enc.set_output_array(out);
    enc.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out), f]() mutable { f(in, out); });
}

class HostSoftmax : public mx::UnaryPrimitive {
   public:
    HostSoftmax(mx::Stream s, int q_rows, int causal_from)
        : mx::UnaryPrimitive(s), q_rows_(q_rows), causal_from_(causal_from) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        dispatch(stream(), inputs, out, [q = q_rows_, c = causal_from_](std::vector<mx::array> &in, mx::array &o) {
            std::vector<float> tmp;
            const float *src = row_major(in[0], tmp);
            float *dst = o.data<float>();
            std::memcpy(dst, src, in[0].nbytes());
            long n = in[0].shape(-1);
            mlxspec_softmax_rows(dst, (long)(in[0].size() / n), n, q, c);
        });
    }
    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("[mlxspec host_softmax] CPU only");
    }
    const char *name() const override { return "MlxspecHostSoftmax"; }
    bool is_equivalent(const mx::Primitive &other) const override {
        auto &o = static_cast<const HostSoftmax &>(other);
        return q_rows_ == o.q_rows_ && causal_from_ == o.causal_from_;
    }

   private:
    int q_rows_, causal_from_;
};

class HostSwiglu : public mx::UnaryPrimitive {
   public:
    explicit HostSwiglu(mx::Stream s) : mx::UnaryPrimitive(s) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        dispatch(stream(), inputs, out, [](std::vector<mx::array> &in, mx::array &o) {
            std::vector<float> tg, tx;
            mlxspec_swiglu(row_major(in[0], tg), row_major(in[1], tx), o.data<float>(), (long)o.size());
        });
    }
    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("[mlxspec host_swiglu] CPU only");
    }
    const char *name() const override { return "MlxspecHostSwiglu"; }
    bool is_equivalent(const mx::Primitive &) const override { return true; }
};

// MLX's CPU attention fallback in one op: q * scale, q @ k^T, the causal mask and softmax, @ v,
// each product by the cblas_sgemm MLX's own matmul calls, with its arguments (a query head's
// rows against its key head's [kL, D] rows, B transposed; then the probabilities against v), so
// every number is the one the op-by-op graph gives (host_math.check compares them bitwise)
class HostAttention : public mx::UnaryPrimitive {
   public:
    HostAttention(mx::Stream s, float scale, int causal_from)
        : mx::UnaryPrimitive(s), scale_(scale), causal_from_(causal_from) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        dispatch(stream(), inputs, out, [scale = scale_, causal = causal_from_](std::vector<mx::array> &in,
                                                                               mx::array &out) {
            const mx::array &q = in[0], &k = in[1], &v = in[2];
            int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
            int Hk = k.shape(1), kL = k.shape(2), rep = Hq / Hk;
            std::vector<float> tq, qs((size_t)B * Hq * L * D), scores((size_t)B * Hq * L * kL);
            const float *qp = row_major(q, tq);
            for (size_t i = 0; i < qs.size(); i++) qs[i] = scale * qp[i];
            // k and v as MLX's matmul reads them: rows of D floats at their own stride (a cache's
            // slice), or gathered into a copy where a row is not contiguous
            std::vector<float> tk, tv;
            int64_t ks[3] = {k.strides()[0], k.strides()[1], k.strides()[2]};
            int64_t vs[3] = {v.strides()[0], v.strides()[1], v.strides()[2]};
            const float *kp = k.data<float>(), *vp = v.data<float>();
            if (k.strides()[3] != 1) {
                kp = row_major(k, tk);
                ks[0] = (int64_t)Hk * kL * D, ks[1] = (int64_t)kL * D, ks[2] = D;
            }
            if (v.strides()[3] != 1) {
                vp = row_major(v, tv);
                vs[0] = (int64_t)Hk * kL * D, vs[1] = (int64_t)kL * D, vs[2] = D;
            }
            float *o = out.data<float>();
            for (int b = 0; b < B; b++)
                for (int h = 0; h < Hq; h++) {
                    size_t bh = (size_t)b * Hq + h;
                    const float *kh = kp + b * ks[0] + (h / rep) * ks[1];
                    cblas_sgemm(101, 111, 112, L, kL, D, 1.0f, qs.data() + bh * L * D, D, kh, (int)ks[2],
                                0.0f, scores.data() + bh * L * kL, kL);
                }
            mlxspec_softmax_rows(scores.data(), (long)B * Hq * L, kL, L, causal);
            for (int b = 0; b < B; b++)
                for (int h = 0; h < Hq; h++) {
                    size_t bh = (size_t)b * Hq + h;
                    const float *vh = vp + b * vs[0] + (h / rep) * vs[1];
                    cblas_sgemm(101, 111, 111, L, D, kL, 1.0f, scores.data() + bh * L * kL, kL, vh, (int)vs[2],
                                0.0f, o + bh * L * D, D);
                }
        });
    }
    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("[mlxspec host_attention] CPU only");
    }
    const char *name() const override { return "MlxspecHostAttention"; }
    bool is_equivalent(const mx::Primitive &other) const override {
        auto &o = static_cast<const HostAttention &>(other);
        return scale_ == o.scale_ && causal_from_ == o.causal_from_;
    }

   private:
    float scale_;
    int causal_from_;
};

// MLX's RoPE fallback on the CPU (mlx/fast.cpp: the rotation as multiplies, a subtract and an add,
// each rounded to float) in one op: out = x1 * cos - x2 * sin, x1 * sin + x2 * cos over the first
// `dims` features (halves, or even / odd features where `traditional`), the rest copied. cos and
// sin [T, dims / 2] ([B, T, dims / 2]: per batch row) are the fallback's own values for the positions (host_rope reads them off
// MLX's rope), so every number is the one the op-by-op graph gives (host_rope.check compares them)
class HostRope : public mx::UnaryPrimitive {
   public:
    HostRope(mx::Stream s, int dims, bool traditional)
        : mx::UnaryPrimitive(s), dims_(dims), traditional_(traditional) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        dispatch(stream(), inputs, out, [dims = dims_, trad = traditional_](std::vector<mx::array> &in,
                                                                          mx::array &o) {
            const mx::array &x = in[0];
            std::vector<float> tc, ts;
            const float *c = row_major(in[1], tc), *sn = row_major(in[2], ts);
            int B = x.shape(0), N = x.shape(1), T = x.shape(2), D = x.shape(3), half = dims / 2;
            bool per_batch = in[1].ndim() == 3;  // [B, T, half]: each batch row at its own positions
            const int64_t *st = x.strides().data();
            const float *xp = x.data<float>();
            float *op = o.data<float>();
            for (int b = 0; b < B; b++)
                for (int n = 0; n < N; n++)
                    for (int t = 0; t < T; t++) {
                        const float *r = xp + b * st[0] + n * st[1] + t * st[2];
                        float *w = op + (((int64_t)b * N + n) * T + t) * D;
                        int64_t row = ((per_batch ? (int64_t)b * T : 0) + t) * half;
                        const float *cr = c + row, *sr = sn + row;
                        int64_t s3 = st[3];
                        for (int i = 0; i < half; i++) {
                            int i1 = trad ? 2 * i : i, i2 = trad ? 2 * i + 1 : i + half;
                            float x1 = r[i1 * s3], x2 = r[i2 * s3];
                            float a = x1 * cr[i], bb = x2 * sr[i];
                            float e = x1 * sr[i], f = x2 * cr[i];
                            w[i1] = a - bb;
                            w[i2] = e + f;
                        }
                        for (int i = dims; i < D; i++) w[i] = r[i * s3];
                    }
        });
    }
    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("[mlxspec host_rope] CPU only");
    }
    const char *name() const override { return "MlxspecHostRope"; }
    bool is_equivalent(const mx::Primitive &other) const override {
        auto &o = static_cast<const HostRope &>(other);
        return dims_ == o.dims_ && traditional_ == o.traditional_;
    }

   private:
    int dims_;
    bool traditional_;
};

void need_float32(const mx::array &a, const char *what) {
    if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + ": float32 only");
}

}  // namespace

// softmax over the last axis; causal_from >= 0: row r keeps columns <= causal_from + r % q_rows
mx::array host_softmax(const mx::array &scores, int q_rows, int causal_from) {
    need_float32(scores, "host_softmax");
    auto s = mx::default_stream(mx::Device::cpu);
    return mx::array(scores.shape(), mx::float32, std::make_shared<HostSoftmax>(s, q_rows, causal_from), {scores});
}

// q [B, Hq, L, D], k and v [B, Hk, kL, D] (rows of D contiguous, e.g. a KV cache's slice)
mx::array host_attention(const mx::array &q, const mx::array &k, const mx::array &v, float scale, int causal_from) {
    need_float32(q, "host_attention");
    need_float32(k, "host_attention");
    need_float32(v, "host_attention");
    if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.shape() != v.shape() || q.shape(0) != k.shape(0) ||
        q.shape(3) != k.shape(3) || q.shape(1) % k.shape(1))
        throw std::invalid_argument("host_attention: q [B, Hq, L, D], k and v [B, Hk, kL, D], Hq a multiple of Hk");
    auto s = mx::default_stream(mx::Device::cpu);
    return mx::array(q.shape(), mx::float32, std::make_shared<HostAttention>(s, scale, causal_from), {q, k, v});
}

mx::array host_swiglu(const mx::array &g, const mx::array &x) {
    need_float32(g, "host_swiglu");
    need_float32(x, "host_swiglu");
    if (g.shape() != x.shape()) throw std::invalid_argument("host_swiglu: the gate and the input differ in shape");
    auto s = mx::default_stream(mx::Device::cpu);
    return mx::array(g.shape(), mx::float32, std::make_shared<HostSwiglu>(s), {g, x});
}

// x [B, N, T, D] (any strides), cos and sin [T, dims / 2] or [B, T, dims / 2] (each batch row at its
// own positions): RoPE over the first dims features
mx::array host_rope(const mx::array &x, const mx::array &cos, const mx::array &sin, int dims, bool traditional) {
    need_float32(x, "host_rope");
    need_float32(cos, "host_rope");
    need_float32(sin, "host_rope");
    bool ok = x.ndim() == 4 && dims > 0 && dims % 2 == 0 && dims <= x.shape(3) && cos.shape() == sin.shape() &&
              (cos.ndim() == 2 || (cos.ndim() == 3 && cos.shape(0) == x.shape(0))) &&
              cos.shape(-2) == x.shape(2) && cos.shape(-1) == dims / 2;
    if (!ok)
        throw std::invalid_argument(
            "host_rope: x [B, N, T, D], cos and sin [T, dims / 2] or [B, T, dims / 2], dims even and <= D");
    auto s = mx::default_stream(mx::Device::cpu);
    return mx::array(x.shape(), mx::float32, std::make_shared<HostRope>(s, dims, traditional), {x, cos, sin});
}

NB_MODULE(mlxspec_mlx_ops, m) {
    nb::module_::import_("mlx.core");  // MLX's array type, registered by its own bindings
    m.def("host_softmax", &host_softmax, nb::arg("scores"), nb::arg("q_rows"), nb::arg("causal_from"));
    m.def("host_swiglu", &host_swiglu, nb::arg("gate"), nb::arg("x"));
    m.def("host_attention", &host_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
          nb::arg("causal_from"));
    m.def("host_rope", &host_rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("dims"),
          nb::arg("traditional"));
    m.def("lanes", []() { return mlxspec_math_lanes(); });
}
