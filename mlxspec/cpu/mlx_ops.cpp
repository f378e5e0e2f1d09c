// The host math of mlxspec.targets.host_math as MLX primitives: MLX's softmax (with the causal
// mask) and mlx-lm's SwiGLU, computed by mlx_math.c (MLX's own arithmetic, 16 lanes) on MLX's CPU
// stream inside the graph. As Python callbacks they needed the graph evaluated up to them (a
// layer's graph cut in two, ~100-200 us here); as primitives they are two more ops. Built by
// mlxspec.cpu_ops against the MLX wheel's headers and nanobind (the ABI MLX's own bindings use).
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

class HostSoftmax : public mx::UnaryPrimitive {
   public:
    HostSoftmax(mx::Stream s, int q_rows, int causal_from)
        : mx::UnaryPrimitive(s), q_rows_(q_rows), causal_from_(causal_from) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        const mx::array &in = inputs[0];
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &enc = mx::cpu::get_command_encoder(stream());
        enc.set_input_array(in);
        enc.set_output_array(out);
        enc.dispatch([in = mx::array::unsafe_weak_copy(in), out = mx::array::unsafe_weak_copy(out),
                      q = q_rows_, c = causal_from_]() mutable {
            std::vector<float> tmp;
            const float *src = row_major(in, tmp);
            float *dst = out.data<float>();
            std::memcpy(dst, src, in.nbytes());
            long n = in.shape(-1);
            mlxspec_softmax_rows(dst, (long)(in.size() / n), n, q, c);
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
        const mx::array &g = inputs[0], &x = inputs[1];
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &enc = mx::cpu::get_command_encoder(stream());
        enc.set_input_array(g);
        enc.set_input_array(x);
        enc.set_output_array(out);
        enc.dispatch([g = mx::array::unsafe_weak_copy(g), x = mx::array::unsafe_weak_copy(x),
                      out = mx::array::unsafe_weak_copy(out)]() mutable {
            std::vector<float> tg, tx;
            mlxspec_swiglu(row_major(g, tg), row_major(x, tx), out.data<float>(), (long)out.size());
        });
    }
    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("[mlxspec host_swiglu] CPU only");
    }
    const char *name() const override { return "MlxspecHostSwiglu"; }
    bool is_equivalent(const mx::Primitive &) const override { return true; }
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

mx::array host_swiglu(const mx::array &g, const mx::array &x) {
    need_float32(g, "host_swiglu");
    need_float32(x, "host_swiglu");
    if (g.shape() != x.shape()) throw std::invalid_argument("host_swiglu: the gate and the input differ in shape");
    auto s = mx::default_stream(mx::Device::cpu);
    return mx::array(g.shape(), mx::float32, std::make_shared<HostSwiglu>(s), {g, x});
}

NB_MODULE(mlxspec_mlx_ops, m) {
    nb::module_::import_("mlx.core");  // MLX's array type, registered by its own bindings
    m.def("host_softmax", &host_softmax, nb::arg("scores"), nb::arg("q_rows"), nb::arg("causal_from"));
    m.def("host_swiglu", &host_swiglu, nb::arg("gate"), nb::arg("x"));
    m.def("lanes", []() { return mlxspec_math_lanes(); });
}
