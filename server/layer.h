// Serving from model weights: embeddings and attention layers in "layer
// mode" (hidden states in, hidden states out).
#ifndef ROPEATTN_SERVER_LAYER_H_
#define ROPEATTN_SERVER_LAYER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention.h"
#include "core/tensor.h"
#include "ropeattn/v1/attention.pb.h"
#include "server/cost.h"
#include "server/handlers.h"
#include "server/model.h"

namespace ropeattn::server {

// q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, D], f32: the layer's
// projections of hidden [B, S, hidden_size] (f32 or bf16), biases included,
// and the model's per-head q/k norms (Qwen3, Gemma 3) applied; before RoPE.
struct Projections {
  Tensor q, k, v;
};
absl::StatusOr<Projections> ProjectQKV(const Model& model, int64_t layer,
                                       const ConstTensorView& hidden, int threads);

// attn [B, S, H, D] (f32) -> [B, S, hidden_size] through o_proj (f32).
absl::StatusOr<Tensor> ProjectOutput(const Model& model, int64_t layer, const ConstTensorView& attn,
                                     int threads);

// The same for the steps of several layer-mode sessions on one layer, each
// input [1, tokens, ...]: their rows stacked and projected by LinearRows, so
// each weight is read once for all of them and each step's result has the
// bits it has projected alone (whoever shares the pass). One result per
// input, in order (a finiteness failure is that input's alone).
std::vector<absl::StatusOr<Projections>> ProjectQKVRows(const Model& model, int64_t layer,
                                                        absl::Span<const ConstTensorView> hidden,
                                                        int threads);
std::vector<absl::StatusOr<Tensor>> ProjectOutputRows(const Model& model, int64_t layer,
                                                      absl::Span<const ConstTensorView> attn,
                                                      int threads);

// The attention a model's layer computes (docs/checkpoints.md): its logit
// scale, soft-cap, sliding window and causality, written into `options`.
// The request's spec may restate each (0 / false means "the model's"); a
// different value is InvalidArgument naming the field, the layer and the
// model's value, as is spec.causal on a bidirectional model.
absl::Status ModelLayerOptions(const ModelConfig& config, int64_t layer,
                               const v1::AttentionSpec& spec, AttentionOptions* options);

// A whole attention layer: projections, the layer's RoPE (RopeOfLayer) at positions
// offsets[b] + s (offsets empty: 0), attention with `options` (q_offsets set
// to the same offsets), output projection. Returns [B, S, hidden_size] f32.
absl::StatusOr<Tensor> LayerForward(const Model& model, int64_t layer,
                                    const ConstTensorView& hidden, AttentionOptions options,
                                    absl::Span<const int64_t> offsets, int threads);

// The layer input of a request: model, layer index and hidden states
// validated against the registry (NotFound for an unknown model, OutOfRange
// for a layer index, InvalidArgument for a hidden shape that is not
// [B, S, hidden_size]).
struct ResolvedLayer {
  std::shared_ptr<const Model> model;
  int64_t layer = 0;
};
// GPT-J rotates from a sinusoid table of n_positions rows, as transformers
// does, which fails past it: OUT_OF_RANGE naming `what` when the positions
// reach `end` - 1 >= n_positions. OK for every other family (their RoPE is
// computed at any position).
absl::Status CheckTablePositions(const ModelConfig& config, int64_t end, absl::string_view what);

absl::StatusOr<ResolvedLayer> ResolveLayer(const ModelRegistry& models, absl::string_view model,
                                           int64_t layer);

// Attend in layer mode (request.layer set), priced then run (handlers.h).
absl::StatusOr<Cost> PriceLayerAttend(const ModelRegistry& models, const v1::AttendRequest& request,
                                      int threads);
absl::Status RunLayerAttend(const ModelRegistry& models, const v1::AttendRequest& request,
                            v1::AttendResponse* response, const ComputeOptions& options);

// Embed: token ids -> embeddings (+ learned or sinusoidal absolute positions
// when the model adds them). InvalidArgument naming the id and its index for
// an id outside the vocabulary; OutOfRange for a position past the model's
// max_positions when it has a position table.
absl::StatusOr<Cost> PriceEmbed(const ModelRegistry& models, const v1::EmbedRequest& request);
absl::Status RunEmbed(const ModelRegistry& models, const v1::EmbedRequest& request,
                      v1::EmbedResponse* response);

void FillModelInfo(const Model& model, v1::ModelInfo* info);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_LAYER_H_
