#include "server/decode_wire.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/attention.h"
#include "core/limits.h"
#include "core/status_macros.h"
#include "server/convert.h"
#include "server/layer.h"

namespace ropeattn::server {

absl::StatusOr<SessionConfig> ResolveOpenSession(const v1::OpenSession& open,
                                                 const ServerOptions& options,
                                                 const ModelRegistry& models) {
  SessionConfig c;
  if (open.model().empty() && open.layer() != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "open.layer = %d is set without open.model: a layer is chosen only in layer mode "
        "(set open.model too, or leave open.layer unset)",
        open.layer()));
  }
  if (!open.model().empty()) {
    // Layer mode: the model's attention geometry and RoPE; only the mask and
    // logit options come from the spec.
    RA_ASSIGN_OR_RETURN(ResolvedLayer r, ResolveLayer(models, open.model(), open.layer()));
    const v1::AttentionSpec& in = open.spec();
    {
      // The first one set, named with its value and the model's.
      const ModelConfig& geometry = r.model->config();
      const struct {
        const char* name;
        int64_t value, model;
      } dims[] = {{"open.spec.heads", in.heads(), geometry.num_heads},
                  {"open.spec.kv_heads", in.kv_heads(), geometry.num_kv_heads},
                  {"open.spec.head_dim", in.head_dim(), geometry.head_dim},
                  {"open.v_dim", open.v_dim(), geometry.head_dim}};
      for (const auto& d : dims) {
        if (d.value != 0) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s = %d is set, but in layer mode it comes from model %s (%d): leave it unset",
              d.name, d.value, open.model(), d.model));
        }
      }
      if (in.positional_case() != v1::AttentionSpec::POSITIONAL_NOT_SET) {
        const google::protobuf::FieldDescriptor* field =
            in.GetDescriptor()->FindFieldByNumber(static_cast<int>(in.positional_case()));
        return absl::InvalidArgumentError(absl::StrCat(
            "open.spec.", field != nullptr ? field->name() : std::string("positional"),
            " is set, but in layer mode the positional scheme comes from model ", open.model(),
            ": leave it unset"));
      }
    }
    if (open.kind() == v1::ATTENTION_KIND_LINEAR) {
      return absl::UnimplementedError("layer mode serves softmax attention only");
    }
    const ModelConfig& mc = r.model->config();
    if (!mc.causal) {
      return absl::UnimplementedError(absl::StrCat(
          "model ", open.model(), " (", FamilyName(mc.family),
          ") attends bidirectionally; decoding sessions need a causal model (use Attend)"));
    }
    AttentionOptions model_options;
    RA_RETURN_IF_ERROR(ModelLayerOptions(mc, r.layer, in, &model_options));
    v1::AttentionSpec spec = in;
    spec.set_heads(mc.num_heads);
    spec.set_kv_heads(mc.num_kv_heads);
    spec.set_head_dim(mc.head_dim);
    spec.set_scale(model_options.scale);
    spec.set_softcap(model_options.softcap);
    spec.set_window(model_options.window);
    RA_ASSIGN_OR_RETURN(c.spec, ResolveSpec(spec));
    if (const RopeConfig* rope = RopeOfLayer(mc, r.layer); rope != nullptr) c.spec.rope = *rope;
    c.spec_proto = spec;
    c.model = r.model;
    c.layer = r.layer;
  } else {
    if (open.spec().has_t5()) {
      // As the proto says: a session has no T5 path. Refused, not computed
      // without its bias.
      return absl::UnimplementedError(
          "open.spec.t5: T5 relative biases are not supported in decoding sessions; use Attend");
    }
    RA_ASSIGN_OR_RETURN(c.spec, ResolveSpec(open.spec()));
    c.spec_proto = open.spec();
  }
  // Kept for the session's life and echoed in its answers: unknown fields
  // (which took 5x their wire bytes in memory, outside the budget) go, and
  // what stays is charged to the session.
  c.spec_proto.DiscardUnknownFields();
  {
    // A fresh copy: the discarded fields' storage stays with the message
    // that held them (protobuf clears, it does not shrink: 2M unknown fields
    // kept 31 MB per session).
    v1::AttentionSpec fresh(c.spec_proto);
    c.spec_proto.Swap(&fresh);
  }
  c.spec_wire_bytes = static_cast<int64_t>(c.spec_proto.ByteSizeLong());
  // The typed spec, and the resolved one's vectors (ALiBi slopes, longrope
  // factors) twice: the config's and the decode state's copy. The resolved
  // vectors need not come from the wire: `heads: 65536, alibi {}` is 10
  // bytes that resolve to 512 KiB of standard slopes.
  c.spec_memory_bytes =
      SatAdd(static_cast<int64_t>(c.spec_proto.SpaceUsedLong()), SatMul(2, ResolvedHeapBytes(c.spec)));
  c.spec.options.causal = true;
  c.start_position = open.start_position();
  if (open.kv_dtype() == v1::DTYPE_INT8) {
    c.int8_kv = true;  // computed in f32 over the stored int8 values
    c.kv_dtype = DType::kF32;
  } else {
    absl::StatusOr<DType> kv = DTypeFromProto(open.kv_dtype(), "open.kv_dtype", DType::kF32);
    if (!kv.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kv.status().message(), " (or DTYPE_INT8 for a softmax session's cache)"));
    }
    c.kv_dtype = *kv;
  }
  RA_ASSIGN_OR_RETURN(c.out_dtype, DTypeFromProto(open.out_dtype(), "open.out_dtype", DType::kF32));
  switch (open.kind()) {
    case v1::ATTENTION_KIND_UNSPECIFIED:
    case v1::ATTENTION_KIND_SOFTMAX:
      c.linear = false;
      break;
    case v1::ATTENTION_KIND_LINEAR:
      c.linear = true;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("open.kind has unknown value %d", static_cast<int>(open.kind())));
  }
  if (open.v_dim() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("open.v_dim must be >= 0, got %d", open.v_dim()));
  }
  c.v_dim = open.v_dim() == 0 || c.model ? c.spec.head_dim : open.v_dim();
  if (c.linear) {
    if (open.spec().has_alibi() || open.spec().has_t5() || open.spec().window() != 0 ||
        open.spec().softcap() != 0) {
      return absl::UnimplementedError(
          "linear-attention sessions support RoPE only: no ALiBi, T5, window or softcap");
    }
    if (open.spec().scale() != 0) {
      // elu(q)+1 and elu(k)+1 carry no score scale: read, it would cancel
      // between numerator and normalizer (all but the epsilon), so it is
      // refused rather than accepted and ignored.
      return absl::UnimplementedError(absl::StrFormat(
          "open.spec.scale %g: linear-attention sessions have no score scale (the elu+1 "
          "feature map takes q and k as they are); leave it 0",
          open.spec().scale()));
    }
    if (c.kv_dtype != DType::kF32 && !c.int8_kv) {
      return absl::InvalidArgumentError(absl::StrCat(
          "open.kv_dtype ", v1::DType_Name(open.kv_dtype()),
          ": a linear-attention session keeps running sums (S, z) in fp64, not a KV cache; "
          "leave it unset or DTYPE_F32"));
    }
    if (LengthDependentRope(c)) {
      return absl::UnimplementedError(absl::StrCat(
          "linear-attention sessions cannot use rope_type \"",
          RopeScalingTypeName(c.spec.rope->scaling.type),
          "\": its frequencies change with the length, and a running sum cannot be re-rotated"));
    }
  }
  if (c.int8_kv && c.linear) {
    return absl::InvalidArgumentError(
        "open.kv_dtype DTYPE_INT8 is a KV cache for softmax sessions; open.kind "
        "ATTENTION_KIND_LINEAR keeps running sums");
  }
  if (c.int8_kv && LengthDependentRope(c)) {
    return absl::UnimplementedError(absl::StrCat(
        "open.kv_dtype DTYPE_INT8 with rope_type \"",
        RopeScalingTypeName(c.spec.rope->scaling.type),
        "\": its keys are rotated again when the length crosses the trained length, and "
        "quantizing them again would round them twice; use DTYPE_F32 or DTYPE_BF16"));
  }
  if (open.max_context() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("open.max_context must be >= 0, got %d", open.max_context()));
  }
  c.max_context = open.max_context() == 0 ? options.default_max_context : open.max_context();
  if (c.max_context > options.max_context_limit) {
    return absl::InvalidArgumentError(
        absl::StrFormat("open.max_context %d exceeds the server's limit of %d tokens",
                        c.max_context, options.max_context_limit));
  }
  const uint32_t ttl = open.idle_ttl_seconds() == 0
                           ? options.default_idle_ttl_seconds
                           : std::min(open.idle_ttl_seconds(), options.max_idle_ttl_seconds);
  c.idle_ttl = absl::Seconds(ttl);
  c.resumable = open.resumable();
  RA_RETURN_IF_ERROR(CheckPositions(c.start_position, std::max<int64_t>(c.max_context, 1),
                                    "open.start_position", "open.max_context (or its default)"));
  if (c.model) {
    // A session whose first token would be past the model's position table
    // could never step.
    RA_RETURN_IF_ERROR(
        CheckTablePositions(c.model->config(), c.start_position + 1, "open.start_position"));
  }
  if (open.has_prefix()) {
    // Shapes, sizes and the key form here, before the session is reserved;
    // the bytes are read when it is filled.
    const v1::KvPrefix& pre = open.prefix();
    if (c.linear) {
      return absl::UnimplementedError(
          "open.prefix: a linear-attention session has no KV to start from");
    }
    if (pre.key_form() != v1::KEY_FORM_RAW && pre.key_form() != v1::KEY_FORM_ROTATED) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "open.prefix.key_form must say how the keys are given (KEY_FORM_RAW or "
          "KEY_FORM_ROTATED), got %d",
          static_cast<int>(pre.key_form())));
    }
    RA_ASSIGN_OR_RETURN(const WireShape k, ParseWireShape(pre.k(), "open.prefix.k"));
    RA_ASSIGN_OR_RETURN(const WireShape v, ParseWireShape(pre.v(), "open.prefix.v"));
    const int64_t tokens = k.rank() == 4 ? k.dim(1) : -1;
    if (k.rank() != 4 || k.dim(0) != 1 || k.dim(2) != c.spec.kv_heads ||
        k.dim(3) != c.spec.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "open.prefix.k must have shape [1, P, %d, %d] ([1, tokens, kv_heads, head_dim]), got %s",
          c.spec.kv_heads, c.spec.head_dim, DimsToString(k.dims)));
    }
    if (v.rank() != 4 || v.dim(0) != 1 || v.dim(1) != tokens || v.dim(2) != c.spec.kv_heads ||
        v.dim(3) != c.v_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "open.prefix.v must have shape [1, %d, %d, %d] (k's tokens, kv_heads, v_dim), got %s",
          tokens, c.spec.kv_heads, c.v_dim, DimsToString(v.dims)));
    }
    if (tokens > c.max_context) {
      return absl::OutOfRangeError(absl::StrFormat(
          "open.prefix holds %d tokens, more than the session's max_context of %d", tokens,
          c.max_context));
    }
    if (c.model) {
      RA_RETURN_IF_ERROR(
          CheckTablePositions(c.model->config(), c.start_position + tokens, "open.prefix"));
    }
  }
  return c;
}

absl::StatusOr<WirePrefix> PrefixFromProto(const v1::KvPrefix& prefix) {
  WirePrefix p;
  RA_ASSIGN_OR_RETURN(p.k, ViewOfWireTensor(prefix.k(), "open.prefix.k", &p.copies[0]));
  RA_ASSIGN_OR_RETURN(p.v, ViewOfWireTensor(prefix.v(), "open.prefix.v", &p.copies[1]));
  p.form = prefix.key_form() == v1::KEY_FORM_ROTATED ? DecodeState::KeyForm::kRotated
                                                      : DecodeState::KeyForm::kRaw;
  return p;
}

absl::StatusOr<Cost> PriceOpen(const SessionConfig& c, const v1::OpenSession& open) {
  Cost cost;
  cost.reply_bytes = SatAdd(SessionInfoBytesBound(c, kMaxSessionIdBytes), kReplyOverheadBytes);
  cost.reply_what = absl::StrFormat("the session's SessionInfo (its spec: %d bytes)",
                                    c.spec_wire_bytes);
  if (open.has_prefix()) {
    RA_ASSIGN_OR_RETURN(const WireShape k, ParseWireShape(open.prefix().k(), "open.prefix.k"));
    RA_ASSIGN_OR_RETURN(const WireShape v, ParseWireShape(open.prefix().v(), "open.prefix.v"));
    const SessionDims dims = SessionDimsOf(c);
    // Copied (and converted) twice, keys rotated element by element.
    int64_t compute = SatMul(SatAdd(SatMul(SatAdd(k.elements, v.elements), 2), k.elements),
                             kElementWeight);
    if (dims.rope_rotary_dim > 0 && dims.kv_heads > 0 && dims.head_dim > 0) {
      const int64_t tokens = k.elements / SatMul(dims.kv_heads, dims.head_dim);
      compute = SatAdd(compute, SatProduct({tokens, dims.rope_rotary_dim / 2,
                                            SinCosWeight(SatAdd(c.start_position, tokens))}));
    }
    cost.compute = compute;
    cost.compute_what = absl::StrFormat("importing a KV prefix of %d key and %d value elements",
                                        k.elements, v.elements);
  }
  return cost;
}

Cost PriceExport(const SessionConfig& c, int64_t position) {
  // Every storage exports its kv dtype (int8: f32, dequantized, as its
  // kv_dtype says).
  const DType dtype = c.kv_dtype;
  // Under a length-dependent rule the keys leave raw, as the state keeps
  // them: f32.
  const DType k_dtype = SessionDimsOf(c).rope_length_dependent ? DType::kF32 : dtype;
  const int64_t k = DenseBytes(SatProduct({position, c.spec.kv_heads, c.spec.head_dim}), k_dtype);
  const int64_t v = DenseBytes(SatProduct({position, c.spec.kv_heads, c.v_dim}), dtype);
  Cost cost;
  cost.reply_bytes = SatAdd(SatAdd(k, v), kReplyOverheadBytes);
  cost.transient_bytes = SatMul(cost.reply_bytes, 2);  // the copies and the message
  cost.compute = SatAdd(k, v);
  cost.reply_what =
      k_dtype == dtype
          ? absl::StrFormat("the KV of %d tokens (%s)", position, DTypeName(dtype))
          : absl::StrFormat("the KV of %d tokens (raw f32 keys, %s values)", position,
                            DTypeName(dtype));
  cost.compute_what = cost.reply_what;
  return cost;
}

namespace {

// A layer-mode session's steps carry hidden states, any other's q/k/v: the
// other form is named as such, before its missing tensors are.
absl::Status CheckStepForm(const SessionConfig& c, const v1::Step& step) {
  if (c.model && (step.has_q() || step.has_k() || step.has_v())) {
    return absl::InvalidArgumentError(
        "this session is in layer mode: steps carry `hidden`, not q/k/v");
  }
  if (!c.model && step.has_hidden()) {
    return absl::InvalidArgumentError(
        "step.hidden is for layer-mode sessions (opened with a model); this session takes q/k/v");
  }
  return absl::OkStatus();
}

}  // namespace

const char* StepAdmissionKind(const SessionConfig& c, const v1::Step& step) {
  const v1::Tensor& t = step.has_hidden() ? step.hidden() : step.q();
  const int64_t tokens = t.shape_size() >= 2 ? t.shape(1) : 0;
  if (c.linear || tokens <= 0) return "Decode.Step";
  return ChooseAttentionPath(tokens, c.spec.heads, c.spec.kv_heads, false) ==
                 AttentionPath::kPrefill
             ? "Decode.Prefill"
             : "Decode.Step";
}

bool StepJoinsBatches(const SessionConfig& c, const v1::Step& step) {
  const v1::Tensor& t = step.has_hidden() ? step.hidden() : step.q();
  const int64_t tokens = t.shape_size() >= 2 ? t.shape(1) : 0;
  return tokens <= kBatchStepMaxTokens &&
         std::string_view(StepAdmissionKind(c, step)) == "Decode.Step";
}

absl::StatusOr<Cost> PriceStep(const SessionConfig& c, const v1::Step& step, int64_t position,
                               int threads) {
  RA_RETURN_IF_ERROR(CheckStepForm(c, step));
  StepDims d;
  d.heads = c.spec.heads;
  d.position = position;
  d.out_dtype = c.out_dtype;
  d.threads = threads;
  if (c.model) {
    RA_ASSIGN_OR_RETURN(const WireShape h, ParseWireShape(step.hidden(), "step.hidden"));
    d.tokens = h.rank() == 3 ? h.dim(1) : 0;
    d.hidden = c.model->config().hidden_size;
    d.wire_bytes = h.bytes;
  } else {
    RA_ASSIGN_OR_RETURN(const WireShape q, ParseWireShape(step.q(), "step.q"));
    RA_ASSIGN_OR_RETURN(const WireShape k, ParseWireShape(step.k(), "step.k"));
    RA_ASSIGN_OR_RETURN(const WireShape v, ParseWireShape(step.v(), "step.v"));
    d.tokens = q.rank() >= 2 ? q.dim(1) : 0;
    d.wire_bytes = SatAdd(SatAdd(q.bytes, k.bytes), v.bytes);
  }
  // Past max_context the step is refused before any work (OutOfRange, by
  // the step itself); price it at the context it may reach.
  d.tokens = std::min(d.tokens, std::max<int64_t>(c.max_context - position, 0));
  return StepCost(SessionDimsOf(c), d);
}

absl::StatusOr<StepInput> StepInputFromProto(const SessionConfig& c, const v1::Step& step,
                                             std::array<Tensor, 3>& copies) {
  StepInput in;
  RA_RETURN_IF_ERROR(CheckStepForm(c, step));
  if (c.model) {
    RA_ASSIGN_OR_RETURN(in.hidden, ViewOfWireTensor(step.hidden(), "step.hidden", &copies[0]));
    return in;
  }
  RA_ASSIGN_OR_RETURN(in.q, ViewOfWireTensor(step.q(), "step.q", &copies[0]));
  RA_ASSIGN_OR_RETURN(in.k, ViewOfWireTensor(step.k(), "step.k", &copies[1]));
  RA_ASSIGN_OR_RETURN(in.v, ViewOfWireTensor(step.v(), "step.v", &copies[2]));
  return in;
}

StepOutput StepOutputInto(v1::Tensor* out) {
  return [out](DType dtype, absl::Span<const int64_t> dims) -> absl::StatusOr<TensorView> {
    return WireTensorForWriting(dtype, dims, out);
  };
}

absl::Status StepFromProto(Session& session, const v1::Step& step, int threads,
                           const StopToken* stop, v1::StepResult* result) {
  std::array<Tensor, 3> copies;
  SessionStep s;
  s.session = &session;
  RA_ASSIGN_OR_RETURN(s.in, StepInputFromProto(session.config(), step, copies));
  s.output = StepOutputInto(result->mutable_out());
  s.stop = stop;
  Session::StepMany(absl::MakeSpan(&s, 1), threads);
  if (!s.status.ok()) {
    result->Clear();  // no half-written answer
    return s.status;
  }
  result->set_seq(step.seq());
  result->set_position(s.position);
  return absl::OkStatus();
}

}  // namespace ropeattn::server
