// plot: SVG charts of what the server computes (RoPE decay and wavelengths
// from its inverse frequencies, its sinusoidal table, its attention
// probabilities).
#include <algorithm>
#include <cmath>
#include <complex>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/commands.h"
#include "client/cli/common.h"
#include "client/cli/svg.h"

ABSL_FLAG(std::string, kind, "decay", "Plot kind: decay, wavelength, sinusoidal or attention.");
ABSL_FLAG(std::vector<std::string>, config, {},
          "decay, wavelength: a RoPE configuration name:rope_type:factor:theta[:L0] "
          "(e.g. \"llama3:llama3:8:500000:8192\"); repeat for several curves. Default: "
          "default, linear x4, ntk x4, yarn x4 (L0 2048), llama3 x8 (theta 500000, L0 8192); "
          "--original_max_positions replaces these L0s and gives one to the configs whose "
          "rule reads it and that write none.");
ABSL_FLAG(int64_t, max_distance, 512, "decay: largest relative distance m - n plotted.");
ABSL_FLAG(int64_t, head, 0, "attention: the head whose probabilities are shown (batch row 0).");
ABSL_FLAG(std::string, title, "", "Chart title; empty means one describing the plot.");

namespace ropeattn::cli {
namespace {

constexpr int64_t kMaxCells = 512 * 512;

struct RopeConfig {
  std::string name;
  v1::RopeSpec rope;
};

// The server refuses an L0 where the rule reads none.
bool RuleReadsL0(absl::string_view rule) {
  return rule != "default" && rule != "linear" && rule != "ntk";
}

// The L0 of the built-in --config defaults stands in for
// --original_max_positions: given, it replaces theirs.
absl::StatusOr<RopeConfig> ParseConfig(absl::string_view text, bool builtin) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() < 2 || parts.size() > 5 || parts[0].empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--config must be name:rope_type[:factor[:theta[:L0]]], got \"", text, "\""));
  }
  RopeConfig config;
  config.name = parts[0];
  absl::StatusOr<v1::RopeSpec> base = RopeSpecFromFlags();
  if (!base.ok()) return base.status();
  config.rope = *base;
  config.rope.mutable_scaling()->set_rope_type(parts[1]);
  double factor = 1, theta = 10000;
  int64_t original = 0;
  if ((parts.size() > 2 && !absl::SimpleAtod(parts[2], &factor)) ||
      (parts.size() > 3 && !absl::SimpleAtod(parts[3], &theta)) ||
      (parts.size() > 4 && !absl::SimpleAtoi(parts[4], &original))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--config \"", text, "\": factor, theta and L0 must be numbers"));
  }
  config.rope.mutable_scaling()->set_factor(factor);
  config.rope.set_theta(theta);
  // --original_max_positions applies to the configs whose rule has one (the base spec from the flags
  // carries it for every rule); an L0 written in the config itself is sent as
  // written.
  const bool reads_l0 = RuleReadsL0(parts[1]);
  if (reads_l0 && (parts.size() < 5 || (builtin && FlagGiven("original_max_positions")))) {
    original = absl::GetFlag(FLAGS_original_max_positions);
  }
  config.rope.mutable_scaling()->set_original_max_position_embeddings(original);
  return config;
}

absl::StatusOr<std::vector<RopeConfig>> ConfigsFromFlags() {
  std::vector<std::string> texts = absl::GetFlag(FLAGS_config);
  const bool builtin = texts.empty();
  if (builtin) {
    texts = {"default:default:1:10000", "linear x4:linear:4:10000", "ntk x4:ntk:4:10000",
             "yarn x4:yarn:4:10000:2048", "llama3 x8:llama3:8:500000:8192"};
  }
  std::vector<RopeConfig> configs;
  for (const std::string& text : texts) {
    absl::StatusOr<RopeConfig> config = ParseConfig(text, builtin);
    if (!config.ok()) return config.status();
    configs.push_back(*std::move(config));
  }
  return configs;
}

// The flags plot reads for `kind`. Each --config (or built-in config) sets
// its curve's rope_type, factor and theta, so --rope_type, --rope_factor and
// --theta have nothing to set under decay and wavelength and are refused
// naming the configs; --original_max_positions is read when a config's rule
// reads an L0 (ConfigL0Conflict refuses it beside a config that writes its
// own).
ModeReads PlotReads(absl::string_view kind) {
  constexpr absl::string_view kAttention[] = {"head", "seed", "batch", "q_len", "k_len",
                                              "v_dim", "dtype", "q", "k", "v"};
  constexpr absl::string_view kSinusoidal[] = {"num_positions", "d_model", "base", "sin_layout",
                                               "first_position"};
  ModeReads reads;
  reads.NotRead(kAttention, "(only --kind attention reads it)");
  reads.NotRead(AttentionSpecFlags(), "(only --kind attention reads it)");
  reads.NotRead(kSinusoidal, "(only --kind sinusoidal reads it)");
  reads.NotRead({"config", "seq_len"}, "(only --kind decay and wavelength read it)");
  reads.NotRead({"head_dim", "rotary_dim", "original_max_positions"},
                "(only --kind decay, wavelength and attention read it)");
  reads.NotRead({"max_distance"}, "(only --kind decay reads it)");
  reads.Read({"kind", "out", "title"});
  if (kind == "sinusoidal") {
    reads.Read(kSinusoidal);
  } else if (kind == "attention") {
    reads.Read({"head"});
    reads.Read(AttentionSpecFlags());
    if (!absl::GetFlag(FLAGS_q).empty() || !absl::GetFlag(FLAGS_k).empty() ||
        !absl::GetFlag(FLAGS_v).empty()) {
      reads.Read({"q", "k", "v"});
      reads.NotRead({"batch", "q_len", "k_len", "dtype", "seed", "v_dim"},
                    "with --q/--k/--v (the inputs' shapes and dtype come from the files)");
    } else {
      reads.Read({"seed", "dtype", "v_dim", "batch", "q_len", "k_len"});
    }
  } else {
    reads.Read({"config", "head_dim", "seq_len", "rotary_dim"});
    if (kind == "decay") reads.Read({"max_distance"});
    const std::vector<std::string> configs = absl::GetFlag(FLAGS_config);
    const std::string which =
        configs.empty() ? "the built-in --config set"
                        : absl::StrCat("--config \"", absl::StrJoin(configs, "\", \""), "\"");
    reads.NotRead({"rope_type", "rope_factor", "theta"},
                  absl::StrCat("beside ", which,
                               " (each config sets its curve's rope_type, factor and theta: "
                               "name:rope_type:factor:theta[:L0])"));
    reads.NotRead({"rope_layout"}, "(the inverse frequencies do not depend on the pair layout)");
    bool reads_l0 = configs.empty();
    for (const std::string& text : configs) {
      const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
      reads_l0 = reads_l0 || (parts.size() >= 2 && RuleReadsL0(parts[1]));
    }
    if (reads_l0) {
      reads.Read({"original_max_positions"});
    } else {
      reads.NotRead({"original_max_positions"},
                    absl::StrCat("beside ", which, " (no rule there reads an L0)"));
    }
  }
  return reads;
}

// --original_max_positions beside a --config that writes its own L0: both
// would set that curve's L0, so neither is dropped silently.
std::optional<std::string> ConfigL0Conflict() {
  if (!FlagGiven("original_max_positions")) return std::nullopt;
  for (const std::string& text : absl::GetFlag(FLAGS_config)) {
    const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
    if (parts.size() > 4) {
      return absl::StrCat("--original_max_positions and --config \"", text,
                          "\" both set that curve's L0; give it in one place");
    }
  }
  return std::nullopt;
}

// The rule's inverse frequencies, as the server computes them.
absl::StatusOr<std::vector<double>> InverseFrequencies(client::Client& client,
                                                       const v1::RopeSpec& rope, int64_t seq_len) {
  v1::EncodeRequest request;
  auto* op = request.mutable_rope_frequencies();
  *op->mutable_rope() = rope;
  op->set_head_dim(absl::GetFlag(FLAGS_head_dim));
  op->set_seq_len(seq_len);
  absl::StatusOr<v1::EncodeResponse> response = client.Encode(request);
  if (!response.ok()) return response.status();
  return std::vector<double>(response->inv_freq().begin(), response->inv_freq().end());
}

// RoFormer section 3.4.3 with h_i = 1: (1/n) sum_{j=1..n} |S_j|, where
// S_j = sum_{k<j} e^{i r theta_k} and n = d/2 pairs.
double DecayBound(absl::Span<const double> inv_freq, double r) {
  std::complex<double> partial = 0;
  double total = 0;
  for (double theta : inv_freq) {
    partial += std::polar(1.0, r * theta);
    total += std::abs(partial);
  }
  return inv_freq.empty() ? 0 : total / inv_freq.size();
}

std::string Title(const std::string& fallback) {
  const std::string title = absl::GetFlag(FLAGS_title);
  return title.empty() ? fallback : title;
}

absl::StatusOr<std::string> PlotDecay(client::Client& client) {
  const int64_t max_distance = absl::GetFlag(FLAGS_max_distance);
  if (max_distance < 1 || max_distance > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_distance must be in [1, 1000000], got ", max_distance));
  }
  absl::StatusOr<std::vector<RopeConfig>> configs = ConfigsFromFlags();
  if (!configs.ok()) return configs.status();
  const int64_t seq_len = FlagGiven("seq_len") ? absl::GetFlag(FLAGS_seq_len) : max_distance + 1;
  std::vector<svg::Series> series;
  for (const RopeConfig& config : *configs) {
    absl::StatusOr<std::vector<double>> inv_freq = InverseFrequencies(client, config.rope, seq_len);
    if (!inv_freq.ok()) return inv_freq.status();
    svg::Series s;
    s.name = config.name;
    for (int64_t r = 0; r <= max_distance; ++r) {
      s.x.push_back(r);
      s.y.push_back(DecayBound(*inv_freq, r));
    }
    std::cout << absl::StrFormat("%-16s %d pairs  bound(0) %.4f  bound(%d) %.4f\n", config.name,
                                 inv_freq->size(), s.y.front(), max_distance, s.y.back());
    series.push_back(std::move(s));
  }
  svg::ChartOptions options;
  options.title =
      Title(absl::StrCat("RoPE long-term decay (head_dim ", absl::GetFlag(FLAGS_head_dim), ")"));
  options.subtitle =
      "(1/(d/2)) \xce\xa3_j |S_j|, S_j = \xce\xa3_{k<j} e^{i r \xce\xb8_k}, \xce\xb8_k: the "
      "server's inverse frequencies (RoFormer 3.4.3)";
  options.x_label = "relative distance m - n";
  options.y_label = "relative upper bound";
  options.y_from_zero = true;
  return svg::LineChart(options, series);
}

absl::StatusOr<std::string> PlotWavelength(client::Client& client) {
  absl::StatusOr<std::vector<RopeConfig>> configs = ConfigsFromFlags();
  if (!configs.ok()) return configs.status();
  std::vector<svg::Series> series;
  for (const RopeConfig& config : *configs) {
    absl::StatusOr<std::vector<double>> inv_freq =
        InverseFrequencies(client, config.rope, absl::GetFlag(FLAGS_seq_len));
    if (!inv_freq.ok()) return inv_freq.status();
    svg::Series s;
    s.name = config.name;
    s.markers = true;
    for (size_t i = 0; i < inv_freq->size(); ++i) {
      s.x.push_back(static_cast<double>(i));
      s.y.push_back(2 * M_PI / (*inv_freq)[i]);
    }
    std::cout << absl::StrFormat("%-16s %d pairs  wavelength %.4g .. %.4g\n", config.name,
                                 inv_freq->size(), s.y.empty() ? 0 : s.y.front(),
                                 s.y.empty() ? 0 : s.y.back());
    series.push_back(std::move(s));
  }
  svg::ChartOptions options;
  options.title = Title(
      absl::StrCat("RoPE wavelength per pair (head_dim ", absl::GetFlag(FLAGS_head_dim), ")"));
  options.subtitle = "\xce\xb8_i: the server's inverse frequencies for each rule";
  options.x_label = "pair index i";
  options.y_label = "wavelength 2\xcf\x80/\xce\xb8_i (tokens, log scale)";
  options.log_y = true;
  return svg::LineChart(options, series);
}

absl::StatusOr<std::string> PlotSinusoidal(client::Client& client) {
  v1::EncodeRequest request;
  auto* op = request.mutable_sinusoidal();
  const int64_t rows = absl::GetFlag(FLAGS_num_positions);
  const int64_t cols = absl::GetFlag(FLAGS_d_model);
  // Each flag first: their product overflowed int64 for large values.
  if (rows < 1 || cols < 1 || rows > kMaxCells || cols > kMaxCells || rows * cols > kMaxCells) {
    return absl::InvalidArgumentError(
        absl::StrCat("plot sinusoidal: --num_positions * --d_model must be in [1, ", kMaxCells,
                     "], got ", rows, " * ", cols));
  }
  op->set_num_positions(rows);
  op->set_d_model(cols);
  op->set_base(absl::GetFlag(FLAGS_base));
  op->set_first_position(absl::GetFlag(FLAGS_first_position));
  const std::string layout = absl::GetFlag(FLAGS_sin_layout);
  if (layout == "interleaved") {
    op->set_layout(v1::SINUSOIDAL_LAYOUT_INTERLEAVED);
  } else if (layout == "sin_cos_half") {
    op->set_layout(v1::SINUSOIDAL_LAYOUT_SIN_COS_HALF);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--sin_layout must be interleaved or sin_cos_half, got \"", layout, "\""));
  }
  absl::StatusOr<v1::EncodeResponse> response = client.Encode(request);
  if (!response.ok()) return response.status();
  absl::StatusOr<std::vector<float>> values = client::ToFloats(response->table());
  if (!values.ok()) return values.status();
  if (static_cast<int64_t>(values->size()) != rows * cols) {
    return absl::InternalError(absl::StrCat("server returned a table ",
                                            DescribeTensor(response->table()), ", expected [", rows,
                                            ", ", cols, "]"));
  }
  std::cout << absl::StrFormat("table    %s  %s\n", DescribeTensor(response->table()),
                               DescribeStats(ComputeStats(*values)));
  svg::HeatmapOptions options;
  options.title = Title(absl::StrCat("Sinusoidal positional encoding (", layout, ")"));
  options.x_label = "dimension";
  options.y_label = "position";
  options.value_label = "PE(pos, dim)";
  options.vmin = -1;
  options.vmax = 1;
  options.diverging = true;
  if (absl::GetFlag(FLAGS_first_position) != 0) {
    options.y_label = absl::StrCat("position - ", absl::GetFlag(FLAGS_first_position));
  }
  return svg::Heatmap(options, rows, cols, *values);
}

absl::StatusOr<std::string> PlotAttention(client::Client& client) {
  const int64_t q_len = absl::GetFlag(FLAGS_q_len);
  const int64_t k_len = absl::GetFlag(FLAGS_k_len) == 0 ? q_len : absl::GetFlag(FLAGS_k_len);
  absl::StatusOr<Inputs> inputs = InputsFromFlags(absl::GetFlag(FLAGS_batch), q_len, k_len);
  if (!inputs.ok()) return inputs.status();
  absl::StatusOr<v1::AttentionSpec> spec = AttentionSpecFromFlags();
  if (!spec.ok()) return spec.status();
  if (!absl::GetFlag(FLAGS_q).empty() && inputs->q.shape_size() == 4 &&
      inputs->k.shape_size() == 4) {
    if (!FlagGiven("heads")) spec->set_heads(inputs->q.shape(2));
    if (!FlagGiven("head_dim")) spec->set_head_dim(inputs->q.shape(3));
    if (!FlagGiven("kv_heads")) spec->set_kv_heads(inputs->k.shape(2));
  }
  const int64_t head = absl::GetFlag(FLAGS_head);
  if (head < 0 || head >= spec->heads()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--head must be in [0, ", spec->heads(), "), got ", head));
  }
  v1::AttendRequest request;
  *request.mutable_spec() = *spec;
  *request.mutable_q() = inputs->q;
  *request.mutable_k() = inputs->k;
  *request.mutable_v() = inputs->v;
  request.set_return_probs(true);
  absl::StatusOr<v1::AttendResponse> response = client.Attend(request);
  if (!response.ok()) return response.status();
  const v1::Tensor& probs = response->probs();
  if (probs.shape_size() != 4 || probs.shape(1) <= head) {
    return absl::InternalError(
        absl::StrCat("server returned probs ", DescribeTensor(probs), ", expected [B, H, Sq, Sk]"));
  }
  const int64_t rows = probs.shape(2), cols = probs.shape(3);
  if (rows * cols > kMaxCells) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plot attention: q_len * k_len must be <= ", kMaxCells, ", got ", rows, " * ", cols));
  }
  absl::StatusOr<std::vector<float>> all = client::ToFloats(probs);
  if (!all.ok()) return all.status();
  const auto begin = all->begin() + head * rows * cols;
  std::vector<float> values(begin, begin + rows * cols);
  float vmax = 0;
  for (float v : values) vmax = std::max(vmax, v);
  std::cout << absl::StrFormat("probs    %s  head %d  max %.4g\n", DescribeTensor(probs), head,
                               vmax);
  svg::HeatmapOptions options;
  options.title = Title(absl::StrCat("Attention probabilities, head ", head));
  options.subtitle = absl::StrCat(DescribeSpec(*spec), "; batch row 0");
  options.x_label = "key position";
  options.y_label = "query index";
  options.value_label = "probability";
  options.vmin = 0;
  options.vmax = vmax > 0 ? vmax : 1;
  return svg::Heatmap(options, rows, cols, values);
}

}  // namespace

int PlotCommand(int argc, char** argv) {
  std::vector<absl::string_view> flags = {"kind",
                                          "out",
                                          "title",
                                          "config",
                                          "max_distance",
                                          "head_dim",
                                          "seq_len",
                                          "num_positions",
                                          "d_model",
                                          "base",
                                          "sin_layout",
                                          "first_position",
                                          "head",
                                          "seed",
                                          "batch",
                                          "q_len",
                                          "k_len",
                                          "v_dim",
                                          "dtype",
                                          "q",
                                          "k",
                                          "v"};
  for (absl::string_view flag : AttentionSpecFlags()) {
    if (std::find(flags.begin(), flags.end(), flag) == flags.end()) flags.push_back(flag);
  }
  int exit_code = 0;
  auto args = ParseSubcommand(
      argc, argv,
      "Writes an SVG chart (--out path.svg) of --kind:\n"
      "  decay       RoPE long-term decay (RoFormer 3.4.3): the relative upper bound\n"
      "              (1/(d/2)) sum_{j=1..d/2} |S_j|, S_j = sum_{k<j} e^{i r theta_k},\n"
      "              for r = 0..--max_distance; one curve per --config, with theta_k\n"
      "              the server's inverse frequencies (Encode rope_frequencies; the\n"
      "              attention factor is left out: the bound is relative)\n"
      "  wavelength  2 pi / theta_i per pair index for each --config (log y axis)\n"
      "  sinusoidal  heatmap of the server's sinusoidal table, position vs dimension\n"
      "              (--num_positions, --d_model, --base, --sin_layout)\n"
      "  attention   heatmap of one head's (--head) attention probabilities from an\n"
      "              Attend with return_probs on random or .npy inputs (attend's flags)\n"
      "A flag the --kind does not read is refused (exit 64); under decay and\n"
      "wavelength each --config sets its curve's rope_type, factor and theta, so\n"
      "--rope_type, --rope_factor and --theta are refused, and so is\n"
      "--original_max_positions beside a --config that writes its own L0.",
      flags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (!args->empty())
    return UsageFail("plot", absl::StrCat("unexpected argument \"", (*args)[0], "\""));
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return UsageFail("plot", "--out path.svg is required");
  const std::string kind = absl::GetFlag(FLAGS_kind);
  if (kind != "decay" && kind != "wavelength" && kind != "sinusoidal" && kind != "attention") {
    return UsageFail("plot", absl::StrCat("--kind must be decay, wavelength, sinusoidal or "
                                          "attention, got \"",
                                          kind, "\""));
  }
  const ModeReads reads = PlotReads(kind);
  if (std::optional<std::string> unread =
          UnreadFlag(flags, {}, absl::StrCat("plot --kind ", kind), reads);
      unread) {
    return UsageFail("plot", *unread);
  }
  if (kind == "decay" || kind == "wavelength") {
    if (std::optional<std::string> conflict = ConfigL0Conflict(); conflict) {
      return UsageFail("plot", *conflict);
    }
  }
  // Checked before the work, not after it.
  if (absl::Status s = CheckOutputPath("out", out); !s.ok()) return Fail("plot", s);
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("plot", client.status());
  absl::StatusOr<std::string> svg_text;
  if (kind == "decay") {
    svg_text = PlotDecay(**client);
  } else if (kind == "wavelength") {
    svg_text = PlotWavelength(**client);
  } else if (kind == "sinusoidal") {
    svg_text = PlotSinusoidal(**client);
  } else {
    svg_text = PlotAttention(**client);
  }
  if (!svg_text.ok()) return Fail("plot", svg_text.status());
  if (absl::Status s = svg::WriteFile(out, *svg_text); !s.ok()) return Fail("plot", s);
  std::cout << "wrote " << out << " (" << kind << ", " << svg_text->size() << " bytes)\n";
  return 0;
}

}  // namespace ropeattn::cli
