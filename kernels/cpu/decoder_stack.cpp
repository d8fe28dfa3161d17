// The whole decoder stack of a Llama-family model for one CPU step in one call: for each layer the input norm,
// the fused q/k/v matmul, q/k norm + rotary + store-KV, paged attention, o_proj, residual add + norm, the fused
// gate/up matmul, SiLU*mul and down_proj; then the final norm. The eager Python step dispatches ~70 aten ops a
// layer from Python (~2,000 a step for SmolLM2); this crosses Python once.
//
// The weights are handed over once at load (stack_new / stack_linear / stack_layer) and held here by reference;
// the matmuls call exactly the ATen ops the Python layers call (at::linear for nn.Linear, oneDNN's
// _linear_pointwise for PackedLinear, _weight_int4pack_mm_for_cpu / _weight_int8pack_mm for the quantized
// layers, the row split of RowSplitLinear), so they give the same results; the elementwise parts are the C++
// kernels of this folder. On CPUs without native bf16 the float32 model's weights can stay compact: 16-bit weights
// (kW16, gemv_bf16.cpp) or GGUF blocks (kGguf, gemv_gguf.cpp), the kernels WeightLinear / GgufLinear call; on
// CPUs with AVX512-BF16 a bf16 model's weights are DpLinear's (kDp, gemv_dpbf16.cpp), and its GGUF layers take
// the bf16 activations as they are.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <vector>

#include "common.h"
#include "ops.h"

namespace kvmesh {
namespace {

enum Kind : int64_t { kDense = 0, kPacked = 1, kInt4 = 2, kInt8 = 3, kSplit = 4, kW16 = 5, kGguf = 6, kDp = 7 };

struct Linear {
  int64_t kind = kDense;
  at::Tensor a;                   // weight, packed weight, int4 packed, int8 weight, 16-bit weight or GGUF codes
  std::optional<at::Tensor> b;    // int4 scales_zeros / int8 scales / GGUF block scales
  std::optional<at::Tensor> bias;
  int64_t group = 0;              // int4 group; kGguf: format + 8 * activation mode (linear_gguf's fmt, act);
                                  // kDp: out features
  int64_t quant = -1, dense = -1, max_rows = 0;  // kSplit: the quantized layer up to max_rows rows, else dense
};

struct Layer {
  at::Tensor in_w, post_w;
  std::optional<at::Tensor> q_norm, k_norm;
  int64_t qkv, o, gate_up, down;
};

struct Stack {
  at::Tensor final_w;
  double eps, scale;
  int64_t heads, kv_heads, head_dim, window;
  std::vector<Linear> linears;
  std::vector<Layer> layers;
  std::vector<at::Tensor> caches;  // k0, v0, k1, v1, ...
};

std::mutex registry_mu;
std::vector<std::shared_ptr<Stack>> registry;

std::shared_ptr<Stack> get(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_mu);
  TORCH_CHECK(handle >= 0 && handle < int64_t(registry.size()) && registry[handle], "decoder stack ", handle,
              " does not exist");
  return registry[handle];
}

at::Tensor packed_linear(const at::Tensor& x, const Linear& l) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, l.a, l.bias ? c10::IValue(*l.bias) : c10::IValue(), c10::IValue("none"),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor apply(const Stack& s, int64_t id, const at::Tensor& x) {
  const Linear& l = s.linears[id];
  switch (l.kind) {
    case kDense:
      return at::linear(x, l.a, l.bias);
    case kPacked:
      return packed_linear(x, l);
    case kInt4:
    case kInt8: {
      // Int4Linear / Int8Linear: bf16 in, the activation dtype out, then the bias in the activation dtype.
      const at::Tensor xb = x.to(at::kBFloat16).contiguous();
      at::Tensor out = l.kind == kInt4 ? at::_weight_int4pack_mm_for_cpu(xb, l.a, l.group, *l.b)
                                       : at::_weight_int8pack_mm(xb, l.a, *l.b);
      out = out.to(x.scalar_type());
      return l.bias ? out + *l.bias : out;
    }
    case kSplit:
      return apply(s, x.size(0) <= l.max_rows ? l.quant : l.dense, x);
    case kW16:
      return linear_w16(x, l.a, l.bias);
    case kGguf:
      return linear_gguf(x, l.a, *l.b, l.bias, l.group % 8, l.group / 8);  // bf16 activations too
    case kDp:
      return linear_dpbf16(x, l.a, l.group, l.bias);
  }
  TORCH_CHECK(false, "decoder stack: unknown linear kind ", l.kind);
}

int64_t stack_new(const at::Tensor& final_w, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
                  double scale, int64_t window) {
  auto s = std::make_shared<Stack>();
  s->final_w = final_w;
  s->eps = eps;
  s->scale = scale;
  s->heads = heads;
  s->kv_heads = kv_heads;
  s->head_dim = head_dim;
  s->window = window;
  std::lock_guard<std::mutex> g(registry_mu);
  registry.push_back(std::move(s));
  return int64_t(registry.size()) - 1;
}

int64_t stack_linear(int64_t handle, int64_t kind, const at::Tensor& a, const std::optional<at::Tensor>& b,
                     const std::optional<at::Tensor>& bias, int64_t group) {
  TORCH_CHECK((kind >= kDense && kind <= kInt8) || kind == kW16 || kind == kGguf || kind == kDp, "stack_linear: kind ",
              kind);
  TORCH_CHECK((kind == kInt4 || kind == kInt8 || kind == kGguf) == b.has_value(),
              "stack_linear: scales for quantized kinds only");
  TORCH_CHECK(kind != kGguf || (group >= 0 && group < 16),
              "stack_linear: GGUF format/activation code ", group);
  auto s = get(handle);
  Linear l;
  l.kind = kind;
  l.a = a;
  l.b = b;
  l.bias = bias;
  l.group = group;
  s->linears.push_back(l);
  return int64_t(s->linears.size()) - 1;
}

int64_t stack_split(int64_t handle, int64_t quant, int64_t dense, int64_t max_rows) {
  auto s = get(handle);
  TORCH_CHECK(quant >= 0 && quant < int64_t(s->linears.size()) && dense >= 0 && dense < int64_t(s->linears.size()),
              "stack_split: unknown linears");
  Linear l;
  l.kind = kSplit;
  l.quant = quant;
  l.dense = dense;
  l.max_rows = max_rows;
  s->linears.push_back(l);
  return int64_t(s->linears.size()) - 1;
}

void stack_layer(int64_t handle, const at::Tensor& in_w, const at::Tensor& post_w,
                 const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, int64_t qkv,
                 int64_t o, int64_t gate_up, int64_t down) {
  auto s = get(handle);
  const int64_t n = int64_t(s->linears.size());
  for (int64_t id : {qkv, o, gate_up, down}) TORCH_CHECK(id >= 0 && id < n, "stack_layer: unknown linear ", id);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "stack_layer: q and k norms come together");
  s->layers.push_back(Layer{in_w, post_w, q_norm, k_norm, qkv, o, gate_up, down});
}

void stack_caches(int64_t handle, at::TensorList caches) {
  auto s = get(handle);
  TORCH_CHECK(int64_t(caches.size()) == 2 * int64_t(s->layers.size()), "stack_caches: K and V for each of ",
              s->layers.size(), " layers, got ", caches.size(), " tensors");
  s->caches.assign(caches.begin(), caches.end());
}

void stack_free(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_mu);
  if (handle >= 0 && handle < int64_t(registry.size())) registry[handle].reset();
}

// x: the step's embeddings [tokens, hidden] (overwritten: it becomes the residual stream). Returns the final
// norm's output. The attention metadata are AttentionMetadata's tensors (kernels/attention_metadata.py).
at::Tensor stack_run(int64_t handle, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                     const at::Tensor& slot_mapping, int64_t num_prefill_tokens, const at::Tensor& query_start,
                     const at::Tensor& prefill_context_lens, const at::Tensor& prefill_block_tables,
                     const at::Tensor& decode_context_lens, const at::Tensor& decode_block_tables) {
  auto sp = get(handle);
  const Stack& s = *sp;
  TORCH_CHECK(!s.caches.empty(), "decoder stack: no KV caches set (stack_caches)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder stack: x [tokens, hidden] contiguous");
  const int64_t tokens = x.size(0), q_size = s.heads * s.head_dim;
  at::Tensor residual = x;
  at::Tensor h = at::empty_like(x);
  at::Tensor hidden;
  for (size_t i = 0; i < s.layers.size(); ++i) {
    const Layer& L = s.layers[i];
    if (i == 0) {
      rms_norm_into(h, x, std::nullopt, L.in_w, s.eps);
    } else {
      rms_norm_into(hidden, hidden, residual, L.in_w, s.eps);  // residual <- mlp out + residual; norm in place
      h = hidden;
    }
    const at::Tensor& kc = s.caches[2 * i];
    const at::Tensor& vc = s.caches[2 * i + 1];
    at::Tensor qkv = apply(s, L.qkv, h);
    at::Tensor q = qk_rope_store(qkv, s.heads, s.kv_heads, s.head_dim, L.q_norm, L.k_norm, s.eps, positions, cos_sin,
                                 kc, vc, slot_mapping);
    at::Tensor attn = paged_attention(q, kc, vc, num_prefill_tokens, query_start, prefill_context_lens,
                                      prefill_block_tables, decode_context_lens, decode_block_tables, s.scale,
                                      s.window);
    at::Tensor o = apply(s, L.o, attn.view({tokens, q_size}));
    rms_norm_into(o, o, residual, L.post_w, s.eps);
    hidden = apply(s, L.down, silu_mul(apply(s, L.gate_up, o)));
    if (!hidden.is_contiguous()) hidden = hidden.contiguous();
  }
  rms_norm_into(hidden, hidden, residual, s.final_w, s.eps);
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("stack_new(Tensor final_norm, float eps, int heads, int kv_heads, int head_dim, float scale, int window) -> int");
  m.def("stack_linear(int handle, int kind, Tensor a, Tensor? b, Tensor? bias, int group) -> int");
  m.def("stack_split(int handle, int quant, int dense, int max_rows) -> int");
  m.def("stack_layer(int handle, Tensor in_norm, Tensor post_norm, Tensor? q_norm, Tensor? k_norm, int qkv, int o, "
        "int gate_up, int down) -> ()");
  m.def("stack_caches(int handle, Tensor[] caches) -> ()");
  m.def("stack_free(int handle) -> ()");
  m.def("stack_run(int handle, Tensor(a!) x, Tensor positions, Tensor cos_sin, Tensor slot_mapping, "
        "int num_prefill_tokens, Tensor query_start, Tensor prefill_context_lens, Tensor prefill_block_tables, "
        "Tensor decode_context_lens, Tensor decode_block_tables) -> Tensor");
  // Ops without tensor arguments have no dispatch key to pick a kernel by: registered as catch-all.
  m.impl("stack_new", &stack_new);
  m.impl("stack_linear", &stack_linear);
  m.impl("stack_split", &stack_split);
  m.impl("stack_layer", &stack_layer);
  m.impl("stack_caches", &stack_caches);
  m.impl("stack_free", &stack_free);
  m.impl("stack_run", &stack_run);
}

}  // namespace kvmesh
