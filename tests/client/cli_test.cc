// End-to-end tests of the `ropeattn` CLI: the real binary runs as a
// subprocess against an in-process server on a loopback port; stdout,
// stderr and the exit code are checked, and the files it writes are read
// back (.npy through the client library, .svg through a small XML parser).
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "core/decode_state.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/tls_test_util.h"
#include "tests/server/server_test_util.h"

namespace ropeattn {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// --- Running the binary. ---

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

std::string ReadWholeFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream buffer;
  buffer << file.rdbuf();
  return buffer.str();
}

std::string MakeTempDir() {
  std::string pattern = absl::StrCat(::testing::TempDir(), "/ropeattn_cli_XXXXXX");
  char* dir = mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr) << "mkdtemp: " << errno;
  return pattern;
}

// Runs ROPEATTN_CLI_PATH with `args`; stdout and stderr go to files (no pipe
// can fill up), killed after 120 s. The child's environment is this
// process's without ROPEATTN_TOKEN (a token in the runner's environment must
// not change what a test sees), plus `env` ("NAME=value" each).
RunResult RunCli(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  static const std::string dir = MakeTempDir();
  static int counter = 0;
  const std::string out_path = absl::StrCat(dir, "/run", counter, ".out");
  const std::string err_path = absl::StrCat(dir, "/run", counter++, ".err");
  const int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int err_fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> argv;
  std::string binary = ROPEATTN_CLI_PATH;
  argv.push_back(binary.data());
  std::vector<std::string> copies = args;
  for (std::string& arg : copies) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_copies = env;
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!absl::StartsWith(*e, "ROPEATTN_TOKEN=")) envp.push_back(*e);
  }
  for (std::string& e : env_copies) envp.push_back(e.data());
  envp.push_back(nullptr);
  RunResult result;
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec (the parent has threads).
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(out_fd);
  close(err_fd);
  if (pid < 0) {
    ADD_FAILURE() << "fork failed: " << errno;
    return result;
  }
  int status = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (true) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "ropeattn timed out: " << ::testing::PrintToString(args);
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = ReadWholeFile(out_path);
  result.err = ReadWholeFile(err_path);
  return result;
}

std::string Describe(const RunResult& r) {
  return absl::StrCat("exit ", r.exit_code, "\n--- stdout:\n", r.out, "--- stderr:\n", r.err);
}

// Pulls the number after `key ` on the line starting with `line_prefix`.
double NumberAfter(const std::string& text, absl::string_view line_prefix, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, line_prefix)) continue;
    std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    for (size_t i = 0; i + 1 < words.size(); ++i) {
      double value;
      if (words[i] == key && absl::SimpleAtod(words[i + 1], &value)) return value;
    }
  }
  ADD_FAILURE() << "no \"" << key << "\" on a line starting with \"" << line_prefix << "\" in\n"
                << text;
  return NAN;
}

// --- A small XML parser: well-formedness (one root, matching tags, quoted
// unique attributes, only the five predefined and numeric entities) and a
// tree to query. ---

struct XmlNode {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::string text;  // concatenated character data of this element
  std::vector<std::unique_ptr<XmlNode>> children;

  void FindAll(absl::string_view element, absl::string_view cls,
               std::vector<const XmlNode*>* found) const {
    auto it = attrs.find("class");
    if (name == element && (cls.empty() || (it != attrs.end() && it->second == cls))) {
      found->push_back(this);
    }
    for (const auto& child : children) child->FindAll(element, cls, found);
  }
  std::vector<const XmlNode*> All(absl::string_view element, absl::string_view cls = "") const {
    std::vector<const XmlNode*> found;
    FindAll(element, cls, &found);
    return found;
  }
  double Num(const std::string& attr) const {
    double value = NAN;
    auto it = attrs.find(attr);
    EXPECT_TRUE(it != attrs.end() && absl::SimpleAtod(it->second, &value))
        << "<" << name << "> attribute " << attr;
    return value;
  }
};

class XmlParser {
 public:
  explicit XmlParser(absl::string_view text) : s_(text) {}

  // The root element, or null with error() set.
  std::unique_ptr<XmlNode> Parse() {
    SkipMisc(/*prolog=*/true);
    if (!error_.empty()) return nullptr;
    auto root = Element();
    if (root == nullptr) return nullptr;
    SkipMisc(/*prolog=*/false);
    if (error_.empty() && pos_ != s_.size()) Error("content after the root element");
    return error_.empty() ? std::move(root) : nullptr;
  }
  const std::string& error() const { return error_; }

 private:
  void Error(absl::string_view what) {
    if (error_.empty()) error_ = absl::StrCat(what, " at byte ", pos_);
  }
  bool At(absl::string_view prefix) const { return absl::StartsWith(s_.substr(pos_), prefix); }
  void SkipSpace() {
    while (pos_ < s_.size() && absl::ascii_isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool SkipUntil(absl::string_view end) {
    size_t found = s_.find(end, pos_);
    if (found == absl::string_view::npos) return false;
    pos_ = found + end.size();
    return true;
  }
  void SkipMisc(bool prolog) {
    while (error_.empty()) {
      SkipSpace();
      if (prolog && pos_ == 0 && At("<?xml")) {
        if (!SkipUntil("?>")) Error("unterminated XML declaration");
      } else if (At("<!--")) {
        if (!SkipUntil("-->")) Error("unterminated comment");
      } else if (At("<?")) {
        if (!SkipUntil("?>")) Error("unterminated processing instruction");
      } else {
        return;
      }
    }
  }
  std::string Name() {
    size_t start = pos_;
    while (pos_ < s_.size()) {
      char c = s_[pos_];
      bool ok = absl::ascii_isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' ||
                (pos_ > start &&
                 (absl::ascii_isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '.'));
      if (!ok) break;
      ++pos_;
    }
    if (pos_ == start) Error("expected a name");
    return std::string(s_.substr(start, pos_ - start));
  }
  // Character data up to `stop` with entities decoded; '<' and a bare '&'
  // are errors.
  std::string CharData(char stop) {
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != stop) {
      char c = s_[pos_];
      if (c == '<') {
        if (stop == '<') break;
        Error("'<' in an attribute value");
        return out;
      }
      if (c == '&') {
        size_t semi = s_.find(';', pos_);
        if (semi == absl::string_view::npos) {
          Error("unterminated entity");
          return out;
        }
        absl::string_view entity = s_.substr(pos_ + 1, semi - pos_ - 1);
        static const std::map<std::string, std::string> kEntities = {
            {"amp", "&"}, {"lt", "<"}, {"gt", ">"}, {"quot", "\""}, {"apos", "'"}};
        if (auto it = kEntities.find(std::string(entity)); it != kEntities.end()) {
          out += it->second;
        } else if (absl::StartsWith(entity, "#")) {
          uint32_t code = 0;
          bool ok = absl::StartsWith(entity, "#x") ? absl::SimpleHexAtoi(entity.substr(2), &code)
                                                   : absl::SimpleAtoi(entity.substr(1), &code);
          if (!ok) {
            Error("bad character reference");
            return out;
          }
          out += code < 0x80 ? std::string(1, static_cast<char>(code)) : "?";
        } else {
          Error(absl::StrCat("unknown entity &", entity, ";"));
          return out;
        }
        pos_ = semi + 1;
        continue;
      }
      out += c;
      ++pos_;
    }
    return out;
  }
  std::unique_ptr<XmlNode> Element() {
    if (!At("<")) {
      Error("expected '<'");
      return nullptr;
    }
    ++pos_;
    auto node = std::make_unique<XmlNode>();
    node->name = Name();
    while (error_.empty()) {
      const size_t before = pos_;
      SkipSpace();
      if (At("/>")) {
        pos_ += 2;
        return node;
      }
      if (At(">")) {
        ++pos_;
        break;
      }
      if (pos_ == before) {
        Error("expected whitespace before an attribute");
        return nullptr;
      }
      std::string attr = Name();
      SkipSpace();
      if (!At("=")) Error(absl::StrCat("attribute ", attr, " without '='"));
      ++pos_;
      SkipSpace();
      if (pos_ >= s_.size() || (s_[pos_] != '"' && s_[pos_] != '\'')) {
        Error(absl::StrCat("attribute ", attr, " is not quoted"));
        return nullptr;
      }
      const char quote = s_[pos_++];
      std::string value = CharData(quote);
      if (pos_ >= s_.size()) Error("unterminated attribute value");
      ++pos_;
      if (!node->attrs.emplace(attr, value).second) {
        Error(absl::StrCat("duplicate attribute ", attr));
      }
    }
    // Content.
    while (error_.empty()) {
      node->text += CharData('<');
      if (pos_ >= s_.size()) {
        Error(absl::StrCat("unclosed <", node->name, ">"));
        break;
      }
      if (At("</")) {
        pos_ += 2;
        std::string end = Name();
        SkipSpace();
        if (end != node->name) Error(absl::StrCat("</", end, "> closes <", node->name, ">"));
        if (!At(">")) Error("expected '>'");
        ++pos_;
        return error_.empty() ? std::move(node) : nullptr;
      }
      if (At("<!--")) {
        if (!SkipUntil("-->")) Error("unterminated comment");
        continue;
      }
      auto child = Element();
      if (child == nullptr) break;
      node->children.push_back(std::move(child));
    }
    return nullptr;
  }

  absl::string_view s_;
  size_t pos_ = 0;
  std::string error_;
};

TEST(XmlParserTest, RejectsMalformedDocuments) {
  for (const char* bad : {"<a><b></a>", "<a x=1/>", "<a>&bogus;</a>", "<a>1 < 2</a>", "<a/><b/>",
                          "<a x=\"1\" x=\"2\"/>", "<a>", "<a x=\"<\"/>"}) {
    XmlParser parser(bad);
    EXPECT_EQ(parser.Parse(), nullptr) << bad;
    EXPECT_FALSE(parser.error().empty()) << bad;
  }
  XmlParser good("<?xml version=\"1.0\"?>\n<a k='v &amp; w'><!-- c --><b>x &lt; y</b><c/></a>\n");
  auto root = good.Parse();
  ASSERT_NE(root, nullptr) << good.error();
  EXPECT_EQ(root->attrs["k"], "v & w");
  ASSERT_EQ(root->children.size(), 2u);
  EXPECT_EQ(root->children[0]->text, "x < y");
}

std::unique_ptr<XmlNode> ParseSvgFile(const std::string& path) {
  const std::string text = ReadWholeFile(path);
  XmlParser parser(text);
  auto root = parser.Parse();
  EXPECT_NE(root, nullptr) << path << " is not well-formed XML: " << parser.error();
  if (root != nullptr) {
    EXPECT_EQ(root->name, "svg");
    EXPECT_EQ(root->attrs["xmlns"], "http://www.w3.org/2000/svg");
  }
  return root;
}

// An axis read back from a chart: tick values (from their labels) and pixel
// positions, and the mapping pixel -> value they define.
struct Axis {
  std::vector<double> values, pixels;
  bool log = false;
  double ToValue(double pixel) const {
    const double a = log ? std::log10(values.front()) : values.front();
    const double b = log ? std::log10(values.back()) : values.back();
    const double v = a + (pixel - pixels.front()) / (pixels.back() - pixels.front()) * (b - a);
    return log ? std::pow(10.0, v) : v;
  }
};

// Reads the ticks of class `cls` ("xtick" / "ytick"): each tick mark's label
// must read as its value, and every tick must lie on the line (linear or
// log) through the first and last.
Axis ReadAxis(const XmlNode& root, const std::string& cls, bool log) {
  Axis axis;
  axis.log = log;
  const std::string coord = cls == "xtick" ? "x1" : "y1";
  std::vector<const XmlNode*> marks = root.All("line", cls);
  std::vector<const XmlNode*> labels = root.All("text", cls + "-label");
  EXPECT_GE(marks.size(), 2u) << cls;
  EXPECT_EQ(marks.size(), labels.size()) << cls;
  for (size_t i = 0; i < marks.size() && i < labels.size(); ++i) {
    double label = NAN;
    EXPECT_TRUE(absl::SimpleAtod(labels[i]->text, &label)) << labels[i]->text;
    EXPECT_NEAR(label, marks[i]->Num("data-value"), 1e-9 * std::max(1.0, std::abs(label)));
    axis.values.push_back(label);
    axis.pixels.push_back(marks[i]->Num(coord));
  }
  if (axis.values.size() >= 2) {
    for (size_t i = 0; i < axis.values.size(); ++i) {
      EXPECT_NEAR(axis.ToValue(axis.pixels[i]), axis.values[i],
                  1e-3 * std::max(1.0, std::abs(axis.values[i])))
          << cls << " tick " << i << " is off the axis scale";
    }
  }
  return axis;
}

std::vector<std::pair<double, double>> ParsePoints(const std::string& points) {
  std::vector<std::pair<double, double>> result;
  for (absl::string_view pair : absl::StrSplit(points, ' ', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> xy = absl::StrSplit(pair, ',');
    double x, y;
    EXPECT_TRUE(absl::SimpleAtod(xy.first, &x) && absl::SimpleAtod(xy.second, &y)) << pair;
    result.emplace_back(x, y);
  }
  return result;
}

// The RoFormer relative upper bound (1/(d/2)) sum_{j=1..d/2} |S_j|,
// S_j = sum_{k<j} e^{i r theta_k}, with the default rule
// theta_k = base^(-2k/d), written independently of the CLI.
double ReferenceDecayBound(int d, double base, double r) {
  std::complex<double> s = 0;
  double total = 0;
  for (int k = 0; k < d / 2; ++k) {
    s += std::exp(std::complex<double>(0, r * std::pow(base, -2.0 * k / d)));
    total += std::abs(s);
  }
  return total / (d / 2);
}

// --- The fixture: one server for the suite. ---

class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = testing::StartTestServer(testing::TestServerOptions()).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { dir_ = MakeTempDir(); }

  static std::string Target() { return absl::StrCat("127.0.0.1:", server_->port()); }
  std::string Path(absl::string_view name) const { return absl::StrCat(dir_, "/", name); }

  // `ropeattn <args[0]> --target=<server> <args[1..]>`.
  static RunResult Cli(std::vector<std::string> args, const std::vector<std::string>& env = {}) {
    args.insert(args.begin() + 1, absl::StrCat("--target=", Target()));
    return RunCli(args, env);
  }

  static std::unique_ptr<client::Client> Client() {
    client::ClientOptions options;
    options.target = Target();
    auto client = client::Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  static server::Server* server_;
  std::string dir_;
};

server::Server* CliTest::server_ = nullptr;

// One line on stderr, "ropeattn <cmd>: <CODE>: ...".
void ExpectOneErrorLine(const RunResult& r, const std::string& command, const std::string& code) {
  EXPECT_THAT(r.err, StartsWith(absl::StrCat("ropeattn ", command, ": ", code, ": ")))
      << Describe(r);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << Describe(r);
}

// --- Usage and help. ---

TEST_F(CliTest, TopLevelHelpListsEverySubcommand) {
  RunResult r = RunCli({"--help"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  for (const char* sub :
       {"health", "info", "sessions", "attend", "encode", "decode", "plot", "bench"}) {
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("  ", sub, " "))) << sub;
  }
  r = RunCli({});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  r = RunCli({"frobnicate"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("unknown subcommand \"frobnicate\""));
}

TEST_F(CliTest, EverySubcommandHelpShowsItsOwnFlagsOnly) {
  struct Case {
    const char* command;
    std::vector<const char*> present, absent;
  };
  const Case cases[] = {
      {"health", {"--service"}, {"--rope_type", "--json", "--kind"}},
      {"info", {"--json"}, {"--service", "--heads"}},
      {"sessions", {"--close", "--json"}, {"--heads", "--op"}},
      {"attend",
       {"--seed",        "--batch",
        "--q_len",       "--k_len",
        "--heads",       "--kv_heads",
        "--head_dim",    "--dtype",
        "--causal",      "--window",
        "--softcap",     "--rope_type",
        "--rope_factor", "--original_max_positions",
        "--rope_layout", "--rotary_dim",
        "--alibi",       "--return_probs",
        "--probs_out",   "--q\n",
        "--k\n",         "--v\n",
        "--out"},
       {"--steps", "--kind", "--op", "--service"}},
      {"encode",
       {"--op", "--d_model", "--positions", "--inverse", "--t5_max_distance"},
       {"--steps", "--kind", "--return_probs"}},
      {"decode",
       {"--steps", "--context", "--tokens_per_step", "--kv_dtype", "--linear"},
       {"--kind", "--op", "--return_probs"}},
      {"plot",
       {"--kind", "--config", "--max_distance", "--head\n", "--out"},
       {"--steps", "--op", "--service"}},
      {"bench", {}, {"--service"}},
  };
  for (const Case& c : cases) {
    RunResult r = RunCli({c.command, "--help"});
    EXPECT_EQ(r.exit_code, 0) << c.command << "\n" << Describe(r);
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("ropeattn ", c.command))) << c.command;
    EXPECT_THAT(r.out, AllOf(HasSubstr("--target"), HasSubstr("--deadline_seconds"))) << c.command;
    for (const char* flag : c.present) EXPECT_THAT(r.out, HasSubstr(flag)) << c.command;
    for (const char* flag : c.absent) EXPECT_THAT(r.out, Not(HasSubstr(flag))) << c.command;
    EXPECT_EQ(r.err, "") << c.command;
  }
}

TEST_F(CliTest, UsageErrorsExit64WithOneLine) {
  RunResult r = Cli({"attend", "--no_such_flag=1"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  ExpectOneErrorLine(r, "attend", "USAGE");
  EXPECT_THAT(r.err, HasSubstr("--no_such_flag"));

  r = Cli({"attend", "--heads", "abc"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  ExpectOneErrorLine(r, "attend", "USAGE");

  // A flag that belongs to another subcommand.
  r = Cli({"health", "--rope_type=yarn"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  ExpectOneErrorLine(r, "health", "USAGE");

  r = Cli({"info", "stray"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);

  r = Cli({"encode", "--op=nope"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  ExpectOneErrorLine(r, "encode", "USAGE");

  // Every integer list is a usage error when it does not parse, whichever
  // subcommand reads it, and an empty element is no number.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"encode", "--op=rope_apply", "--positions=1,x,3"},
           {"encode", "--op=rope_apply", "--offsets=1,,2"},
           {"attend", "--offsets=1,x"},
           {"embed", "--model=demo", "--tokens=1,2,x"},
           {"bench", "--concurrency=1,,2"}}) {
    r = Cli(args);
    EXPECT_EQ(r.exit_code, 64) << absl::StrJoin(args, " ") << ": " << Describe(r);
    ExpectOneErrorLine(r, args[0], "USAGE");
    EXPECT_THAT(r.err, HasSubstr("must be comma-separated integers"));
  }
  // A flag the chosen op or mode does not read: refused, not ignored.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"encode", "--op=sinusoidal", "--positions=1,2"},
           {"encode", "--op=alibi", "--offsets=1"},
           {"encode", "--op=rope_cos_sin", "--x=/nonexistent.npy"},
           {"attend", "--model=demo", "--layer=0", "--k_len=5"}}) {
    r = Cli(args);
    EXPECT_EQ(r.exit_code, 64) << absl::StrJoin(args, " ") << ": " << Describe(r);
    ExpectOneErrorLine(r, args[0], "USAGE");
  }
  // Every encode op refuses each flag it does not read, naming it and the
  // op (--rope_type with sinusoidal, --d_model with alibi, --inverse with
  // rope_frequencies were ignored).
  for (const auto& [args, says] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--op=sinusoidal", "--rope_type=yarn"}, "--rope_type is not read by --op sinusoidal"},
           {{"--op=sinusoidal", "--heads=2"}, "--heads is not read by --op sinusoidal"},
           {{"--op=alibi", "--d_model=7"}, "--d_model is not read by --op alibi"},
           {{"--op=alibi", "--k_len=4"}, "--k_len is not read by --op alibi without --q_len"},
           {{"--op=alibi", "--bidirectional"},
            "--bidirectional is not read by --op alibi without --q_len"},
           {{"--op=rope_frequencies", "--inverse"},
            "--inverse is not read by --op rope_frequencies"},
           {{"--op=rope_frequencies", "--num_positions=4"},
            "--num_positions is not read by --op rope_frequencies"},
           {{"--op=rope_cos_sin", "--positions=1", "--num_positions=4"},
            "--num_positions is not read by --op rope_cos_sin with --positions"},
           {{"--op=rope_cos_sin", "--seed=2"}, "--seed is not read by --op rope_cos_sin"},
           {{"--op=rope_apply", "--x=/nonexistent.npy", "--head_dim=8"},
            "--head_dim is not read by --op rope_apply with --x"},
           {{"--op=rope_apply", "--k_len=4"}, "--k_len is not read by --op rope_apply"},
           {{"--op=t5", "--heads=4"}, "--heads is not read by --op t5"},
           {{"--op=t5", "--seq_len=4"}, "--seq_len is not read by --op t5"}}) {
    std::vector<std::string> full = {"encode"};
    full.insert(full.end(), args.begin(), args.end());
    r = Cli(full);
    EXPECT_EQ(r.exit_code, 64) << absl::StrJoin(full, " ") << ": " << Describe(r);
    ExpectOneErrorLine(r, "encode", "USAGE");
    EXPECT_THAT(r.err, HasSubstr(says)) << absl::StrJoin(full, " ");
  }
}

// attend and decode refuse, naming it and the mode, every flag the mode their
// command line picks does not read: --hidden and --layer without --model
// were ignored (random q, k, v attended instead), as were decode's --seed and
// --dtype beside --q/--k/--v and layer-mode attend's --q_len and --seed
// beside --hidden. The files need not exist: the refusal comes first.
TEST_F(CliTest, AttendAndDecodeRefuseTheFlagsTheirModeDoesNotRead) {
  const std::vector<std::string> files = {"--q=/none/q.npy", "--k=/none/k.npy", "--v=/none/v.npy"};
  auto with_files = [&](std::vector<std::string> args) {
    args.insert(args.begin() + 1, files.begin(), files.end());
    return args;
  };
  const std::string random = "with random q, k, v", npy = "with --q/--k/--v",
                    layer = "in layer mode (--model)";
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"attend", "--hidden=/none/h.npy", "--causal"},
            "--hidden is not read by attend " + random},
           {{"attend", "--layer=1"}, "--layer is not read by attend " + random},
           {with_files({"attend", "--layer=0"}), "--layer is not read by attend " + npy},
           {with_files({"attend", "--v_dim=8"}), "--v_dim is not read by attend " + npy},
           {{"attend", "--model=demo", "--hidden=/none/h.npy", "--q_len=3"},
            "--q_len is not read by attend " + layer + " with --hidden"},
           {{"attend", "--model=demo", "--hidden=/none/h.npy", "--seed=3"},
            "--seed is not read by attend " + layer + " with --hidden"},
           {{"attend", "--model=demo", "--hidden=/none/h.npy", "--batch=2"},
            "--batch is not read by attend " + layer + " with --hidden"},
           {{"attend", "--model=demo", "--hidden=/none/h.npy", "--dtype=bf16"},
            "--dtype is not read by attend " + layer + " with --hidden"},
           {{"attend", "--model=demo", "--k_len=5"}, "--k_len is not read by attend " + layer},
           {{"attend", "--model=demo", "--v_dim=8"}, "--v_dim is not read by attend " + layer},
           {{"attend", "--model=demo", "--theta=500"}, "--theta is not read by attend " + layer},
           {with_files({"attend", "--model=demo"}), "--q is not read by attend " + layer},
           {{"decode", "--hidden=/none/h.npy", "--steps=1"},
            "--hidden is not read by decode " + random},
           {{"decode", "--layer=1", "--steps=1"}, "--layer is not read by decode " + random},
           {with_files({"decode", "--seed=5"}), "--seed is not read by decode " + npy},
           {with_files({"decode", "--dtype=bf16"}), "--dtype is not read by decode " + npy},
           {with_files({"decode", "--v_dim=8"}), "--v_dim is not read by decode " + npy},
           {with_files({"decode", "--hidden=/none/h.npy"}),
            "--hidden is not read by decode " + npy},
           {{"decode", "--model=demo", "--hidden=/none/h.npy", "--seed=5"},
            "--seed is not read by decode " + layer + " with --hidden"},
           {{"decode", "--model=demo", "--hidden=/none/h.npy", "--dtype=bf16"},
            "--dtype is not read by decode " + layer + " with --hidden"},
           {{"decode", "--model=demo", "--heads=4"}, "--heads is not read by decode " + layer},
           {{"decode", "--model=demo", "--v_dim=8"}, "--v_dim is not read by decode " + layer},
           {with_files({"decode", "--model=demo"}), "--q is not read by decode " + layer}}) {
    RunResult r = Cli(args);
    EXPECT_EQ(r.exit_code, 64) << absl::StrJoin(args, " ") << ": " << Describe(r);
    ExpectOneErrorLine(r, args[0], "USAGE");
    EXPECT_THAT(r.err, HasSubstr(says)) << absl::StrJoin(args, " ");
  }
}

// A flag given empty is not given, in the mode checks as in the commands:
// `--hidden=` picks random hidden states, `--q=` random q, k, v, and the
// flags those modes read were refused (exit 64, "--seed is not read by attend
// in layer mode (--model) with --hidden", "--q is not read by attend with
// random q, k, v").
TEST_F(CliTest, AFlagGivenEmptyIsNotGivenToTheModeChecks) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"attend", "--model=demo", "--hidden=", "--seed=5"},
           {"decode", "--model=demo", "--hidden=", "--dtype=bf16"},
           {"attend", "--q=", "--seed=3"}}) {
    RunResult r = Cli(args);
    EXPECT_EQ(r.exit_code, 0) << absl::StrJoin(args, " ") << ": " << Describe(r);
    EXPECT_THAT(r.err, Not(HasSubstr("is not read by"))) << absl::StrJoin(args, " ");
  }
}

// decode's --context / --steps / --tokens_per_step were summed (in int64,
// unchecked: 2^63 - 1 wrapped negative) before any check, and the sum was
// reported as --q_len, a flag decode does not have. Each flag is checked
// first, named with the value given. bench and encode likewise.
TEST_F(CliTest, SizeFlagsAreCheckedBeforeArithmeticNamingTheFlag) {
  const struct {
    std::vector<std::string> args;
    std::string says;
  } cases[] = {
      {{"decode", "--context=99999999999"}, "--context must be in [0, 2^24], got 99999999999"},
      {{"decode", "--context=9223372036854775807"},
       "--context must be in [0, 2^24], got 9223372036854775807"},
      {{"decode", "--steps=9223372036854775807", "--tokens_per_step=2"},
       "--steps must be in [1, 2^24], got 9223372036854775807"},
      {{"decode", "--tokens_per_step=0"}, "--tokens_per_step must be in [1, 2^24], got 0"},
      {{"decode", "--prefill_chunk=-1"}, "--prefill_chunk must be in [1, 2^24], got -1"},
      {{"decode", "--steps=16777216", "--tokens_per_step=2"},
       "--context + --steps * --tokens_per_step (the random inputs' tokens) must be at most "
       "2^24, got 0 + 16777216 * 2 = 33554432"},
      {{"decode", "--model=demo", "--context=16777216"},
       "--context + --steps * --tokens_per_step"},
      {{"encode", "--op=rope_cos_sin", "--num_positions=99999999999"},
       "--num_positions must be in [1, 2^24]"},
      {{"encode", "--op=rope_apply", "--heads=9223372036854775807"},
       "--heads must be in [1, 2^24], got 9223372036854775807"},
      // Every encode op's size flags, before anything is sent (the server's
      // errors named alibi.heads, rope_frequencies.head_dim).
      {{"encode", "--op=alibi", "--heads=0"}, "--heads must be in [1, 2^24], got 0"},
      {{"encode", "--op=alibi", "--heads=100000000"},
       "--heads must be in [1, 2^24], got 100000000"},
      {{"encode", "--op=alibi", "--q_len=-1"}, "--q_len must be in [1, 2^24], got -1"},
      {{"encode", "--op=alibi", "--q_len=2", "--k_len=-3"}, "--k_len must be in [1, 2^24], got -3"},
      {{"encode", "--op=rope_frequencies", "--head_dim=0"}, "--head_dim must be in [1, 2^24], got 0"},
      {{"encode", "--op=rope_cos_sin", "--head_dim=-2"}, "--head_dim must be in [1, 2^24], got -2"},
      {{"encode", "--op=t5", "--q_len=0"}, "--q_len must be in [1, 2^24], got 0"},
      {{"encode", "--op=t5", "--k_len=99999999"}, "--k_len must be in [1, 2^24], got 99999999"},
      {{"bench", "--workload=decode", "--context=9223372036854775807"},
       "--context must be in [0, 2^24], got 9223372036854775807"},
      {{"bench", "--workload=decode", "--steps_per_session=9223372036854775807",
        "--tokens_per_step=2"},
       "--steps_per_session must be in [1, 2^24], got 9223372036854775807"},
      {{"bench", "--q_len=0"}, "--q_len must be in [1, 2^24], got 0"},
      {{"plot", "--kind=sinusoidal", "--num_positions=4611686018427387904", "--d_model=4",
        "--out=x.svg"},
       "--num_positions * --d_model must be in [1, 262144], got 4611686018427387904 * 4"},
  };
  for (const auto& c : cases) {
    const RunResult r = Cli(c.args);
    EXPECT_EQ(r.exit_code, 3) << absl::StrJoin(c.args, " ") << ": " << Describe(r);
    ExpectOneErrorLine(r, c.args[0], "INVALID_ARGUMENT");
    EXPECT_THAT(r.err, HasSubstr(c.says)) << absl::StrJoin(c.args, " ");
    if (c.args[0] == "decode") {
      EXPECT_THAT(r.err, Not(HasSubstr("--q_len"))) << absl::StrJoin(c.args, " ");
    }
  }
  // Random payloads that could never be sent are refused before they are
  // generated (bench allocated them first).
  for (const auto& [args, says] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"bench", "--q_len=1000000"},
            "an Attend of --batch 1, --q_len 1000000, --k_len 1000000 is 6144000000 bytes"},
           {{"bench", "--workload=decode", "--context=16000000"},
            "the prefill of --context 16000000 is 98304000000 bytes"},
           {{"encode", "--op=rope_apply", "--q_len=9999999"},
            "x of [--batch 1, --q_len 9999999, --heads 8, --head_dim 64] is 20479997952 bytes"}}) {
    const RunResult r = Cli(args);
    EXPECT_EQ(r.exit_code, 8) << absl::StrJoin(args, " ") << ": " << Describe(r);
    ExpectOneErrorLine(r, args[0], "RESOURCE_EXHAUSTED");
    EXPECT_THAT(r.err, AllOf(HasSubstr(says), HasSubstr("--max_message_bytes 268435456")));
  }
}

// Output files are checked before the work: attend --out /nonexistent/dir/x
// ran the call, printed its summary, and only then failed to write; bench
// ran its whole sweep first. The error names the flag and the path.
TEST_F(CliTest, OutputPathsAreCheckedBeforeTheWork) {
  const std::string missing = "/nonexistent/dir/x.npy";
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"attend", "--q_len=2", "--heads=2", "--head_dim=8", "--out", missing},
           {"attend", "--q_len=2", "--heads=2", "--head_dim=8", "--probs_out", missing},
           {"attend", "--model=demo", "--layer=0", "--q_len=2", "--out", missing},
           {"encode", "--op=sinusoidal", "--out", missing},
           {"decode", "--steps=1", "--heads=2", "--head_dim=8", "--out", missing},
           {"embed", "--model=demo", "--tokens=1,2", "--out", missing},
           {"plot", "--kind=wavelength", "--out", missing},
           {"bench", "--concurrency=1", "--window_seconds=0.1", "--warmup_seconds=0",
            "--max_windows=3", "--q_len=2", "--heads=2", "--head_dim=8", "--requests_out",
            missing},
           {"bench", "--concurrency=1", "--window_seconds=0.1", "--warmup_seconds=0",
            "--max_windows=3", "--q_len=2", "--heads=2", "--head_dim=8", "--csv", missing}}) {
    const RunResult r = Cli(args);
    const std::string flag = args[args.size() - 2];
    EXPECT_EQ(r.exit_code, 5) << absl::StrJoin(args, " ") << ": " << Describe(r);
    ExpectOneErrorLine(r, args[0], "NOT_FOUND");
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat(flag, ": cannot write ", missing,
                                              " (directory /nonexistent/dir)")))
        << absl::StrJoin(args, " ");
    EXPECT_EQ(r.out, "") << absl::StrJoin(args, " ");  // nothing ran
  }
  // A directory, or a file in a path whose parent is a file.
  RunResult r = Cli({"encode", "--op=sinusoidal", "--out", dir_});
  EXPECT_NE(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--out: cannot write ", dir_)));
  EXPECT_EQ(r.out, "");
  const std::string file = Path("plain");
  std::ofstream(file) << "x";
  r = Cli({"encode", "--op=sinusoidal", "--out", file + "/x.npy"});
  EXPECT_NE(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("Not a directory"));
  // A writable one still works.
  r = Cli({"encode", "--op=sinusoidal", "--out", Path("ok.npy")});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
}

// decode sends its tokens in slices: a run whose whole q/k/v exceed
// --max_message_bytes is fine as long as each slice fits (the one-message
// check of attend must not apply to it).
TEST_F(CliTest, DecodeRunsLargerThanOneMessageAreSentInSlices) {
  const RunResult r = Cli({"decode", "--context=64", "--prefill_chunk=8", "--steps=4",
                           "--heads=2", "--head_dim=8", "--max_message_bytes=8192"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
}

// --offsets reaches the server in plain (not only layer) mode: it was read
// only in layer mode and silently ignored otherwise.
TEST_F(CliTest, AttendSendsItsOffsets) {
  RunResult r = Cli({"attend", "--q_len=2", "--k_len=4", "--heads=2", "--head_dim=8",
                     "--offsets=-1"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "attend", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, HasSubstr("q_offsets"));
  r = Cli({"attend", "--q_len=2", "--k_len=4", "--heads=2", "--head_dim=8", "--offsets=1"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
}

// A request larger than --max_message_bytes is refused before anything is
// generated or sent (above 2 GiB, protobuf's serializer used to abort the
// process): RESOURCE_EXHAUSTED naming the bytes, at once.
TEST_F(CliTest, ARequestPastTheMessageLimitIsRefusedBeforeItIsBuilt) {
  const RunResult r =
      Cli({"attend", "--q_len=24576", "--heads=64", "--head_dim=128"});
  EXPECT_EQ(r.exit_code, 8) << Describe(r);
  ExpectOneErrorLine(r, "attend", "RESOURCE_EXHAUSTED");
  EXPECT_THAT(r.err, HasSubstr("2415919104 bytes, more than --max_message_bytes 268435456"));
}

// A --max_message_bytes out of range is a usage error on every command
// (attend compared its inputs against it first: RESOURCE_EXHAUSTED for 0).
TEST_F(CliTest, AMessageLimitOutOfRangeIsInvalidOnAttend) {
  for (const char* bad : {"--max_message_bytes=0", "--max_message_bytes=-5"}) {
    const RunResult r = Cli({"attend", bad});
    EXPECT_EQ(r.exit_code, 3) << Describe(r);
    ExpectOneErrorLine(r, "attend", "INVALID_ARGUMENT");
    EXPECT_THAT(r.err, HasSubstr("--max_message_bytes must be in [1, 2147483647]"));
  }
}

// --- TLS and token flags: help and what is refused before any call. ---

// The help text of `flag` in `help` (the indented lines below its name),
// unwrapped: words joined by single spaces.
std::string FlagHelp(const std::string& help, const std::string& flag) {
  const size_t at = help.find(absl::StrCat("  ", flag, "\n"));
  if (at == std::string::npos) return "";
  const size_t end = help.find("\n  --", at + 1);
  const std::string text = help.substr(at, end == std::string::npos ? std::string::npos : end - at);
  return absl::StrJoin(absl::StrSplit(text, absl::ByAnyChar(" \n"), absl::SkipEmpty()), " ");
}

TEST_F(CliTest, EveryServerSubcommandTakesTheTlsAndTokenFlags) {
  for (const char* command : {"health", "info", "sessions", "models", "embed", "attend", "encode",
                              "decode", "plot", "bench"}) {
    RunResult r = RunCli({command, "--help"});
    EXPECT_EQ(r.exit_code, 0) << command << "\n" << Describe(r);
    for (const char* flag : {"--tls_ca_file", "--tls_cert_file", "--tls_key_file", "--token"}) {
      EXPECT_THAT(r.out, HasSubstr(absl::StrCat("  ", flag, "\n"))) << command << " " << flag;
    }
    const std::string token_help = FlagHelp(r.out, "--token");
    EXPECT_THAT(token_help,
                AllOf(HasSubstr("Bearer"), HasSubstr("ROPEATTN_TOKEN"), HasSubstr("needs TLS")))
        << command;
  }
  // embed has both: the bearer token and the token ids, told apart.
  RunResult r = RunCli({"embed", "--help"});
  EXPECT_THAT(FlagHelp(r.out, "--token"), HasSubstr("Not embed's --tokens (token ids)"));
  EXPECT_THAT(FlagHelp(r.out, "--tokens"), AllOf(HasSubstr("token ids"), Not(HasSubstr("Bearer"))));
  r = RunCli({"--help"});
  EXPECT_THAT(r.out, AllOf(HasSubstr("--tls_ca_file"), HasSubstr("ROPEATTN_TOKEN")));
}

TEST_F(CliTest, TokenWithoutTlsIsRefusedAndNeverPrinted) {
  const std::string token = "cli-tok-51d0e7";
  RunResult r = Cli({"info", absl::StrCat("--token=", token)});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "info", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, HasSubstr("token needs TLS"));
  EXPECT_THAT(r.out + r.err, Not(HasSubstr(token)));

  // From the environment: the same refusal, saying where the token came from.
  r = Cli({"health"}, {absl::StrCat("ROPEATTN_TOKEN=", token)});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "health", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, AllOf(HasSubstr("token needs TLS"), HasSubstr("$ROPEATTN_TOKEN")));
  EXPECT_THAT(r.out + r.err, Not(HasSubstr(token)));

  // --token= overrides the environment: no token, plaintext is fine.
  r = Cli({"health", "--token="}, {absl::StrCat("ROPEATTN_TOKEN=", token)});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, "SERVING\n");
}

TEST_F(CliTest, BadTlsFlagsAreInvalidArgumentNamingTheFile) {
  const std::string missing = Path("no-such-ca.pem");
  RunResult r = Cli({"health", absl::StrCat("--tls_ca_file=", missing)});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "health", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("tls_ca_file \"", missing, "\" cannot be read")));

  r = Cli({"bench", "--concurrency=1", "--tls_cert_file=/dev/null"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "bench", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, HasSubstr("tls_cert_file is set, tls_key_file is empty"));
}

// --- health / info / sessions. ---

TEST_F(CliTest, HealthServing) {
  RunResult r = Cli({"health"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, "SERVING\n");
  EXPECT_EQ(r.err, "");
}

TEST_F(CliTest, HealthWithNoServerIsUnavailable) {
  // A port bound but not listening: connections are refused, and nothing
  // else can take it while the test runs.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  RunResult r = RunCli({"health", absl::StrCat("--target=127.0.0.1:", ntohs(addr.sin_port)),
                        "--deadline_seconds=5"});
  close(fd);
  EXPECT_EQ(r.exit_code, 14) << Describe(r);
  ExpectOneErrorLine(r, "health", "UNAVAILABLE");
}

// A --target port past 65535 reached another port (gRPC keeps the low 16
// bits: 114146 dials 48610, token and all). Refused before any connection,
// naming the flag and the value, on every subcommand (Connect checks it).
TEST_F(CliTest, ATargetPortPast65535IsRefused) {
  const int wrapped = server_->port() + 65536;
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"health"}, {"info"}, {"attend", "--q_len=2"}}) {
    std::vector<std::string> full = args;
    const std::string target = absl::StrCat("127.0.0.1:", wrapped);
    full.push_back(absl::StrCat("--target=", target));
    const RunResult r = RunCli(full);
    EXPECT_EQ(r.exit_code, 3) << Describe(r);
    ExpectOneErrorLine(r, args[0], "INVALID_ARGUMENT");
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--target \"", target,
                                              "\": the port must be a number in 1..65535")));
    EXPECT_EQ(r.out, "");
  }
}

TEST_F(CliTest, HealthNotServingExits14) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  server->SetServingForTest(false);
  RunResult r = RunCli({"health", absl::StrCat("--target=127.0.0.1:", server->port())});
  EXPECT_EQ(r.exit_code, 14) << Describe(r);
  EXPECT_EQ(r.out, "NOT_SERVING\n");
  ExpectOneErrorLine(r, "health", "UNAVAILABLE");
  EXPECT_THAT(r.err, HasSubstr("NOT_SERVING"));
}

TEST_F(CliTest, InfoHumanAndJson) {
  const server::ServerOptions& options = server_->options();
  RunResult r = Cli({"info"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("version"));
  EXPECT_THAT(r.out, HasSubstr("cpu"));
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("/ ", options.memory_budget_bytes, " bytes")));
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("of max ", options.max_sessions)));

  r = Cli({"info", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  // proto3 JSON: int64 as strings, int32 as numbers.
  EXPECT_THAT(
      r.out, HasSubstr(absl::StrCat("\"kv_budget_bytes\": \"", options.memory_budget_bytes, "\"")));
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("\"max_sessions\": ", options.max_sessions)));
  EXPECT_THAT(r.out, HasSubstr("\"open_sessions\": "));
}

TEST_F(CliTest, SessionsListsAndCloses) {
  auto client = Client();
  ASSERT_NE(client, nullptr);
  v1::OpenSession open;
  open.mutable_spec()->set_heads(2);
  open.mutable_spec()->set_head_dim(8);
  open.set_resumable(true);
  open.set_max_context(64);
  // bf16: pages of 16 tokens on every machine (f32 pages hold 64 tokens
  // where the tiled f32 decode runs).
  open.set_kv_dtype(v1::DTYPE_BF16);
  auto session = client->OpenSession(open);
  ASSERT_TRUE(session.ok()) << session.status();
  const int64_t shape[] = {1, 3, 2, 8};
  auto q = client::RandomTensor(v1::DTYPE_F32, shape, 1);
  ASSERT_TRUE(q.ok());
  ASSERT_TRUE((*session)->Step(*q, *q, *q).ok());
  const std::string id = (*session)->id();

  RunResult r = Cli({"sessions"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("POSITION"));
  std::vector<std::string> row;
  for (absl::string_view line : absl::StrSplit(r.out, '\n')) {
    if (absl::StartsWith(line, id)) row = absl::StrSplit(line, ' ', absl::SkipEmpty());
  }
  // id, position, max_context, kind, kv dtype, attached, idle s, KV bytes
  // charged, held, shared.
  ASSERT_EQ(row.size(), 10u) << r.out;
  // 3 tokens hold one page of the 64 / P charged for max_context 64 (P: 16
  // tokens, or 32 in tile pages on AVX-512 machines; a token is 2 kv heads x
  // 8 bf16 values in K and as many in V, a page charged what its two parts
  // hold resident, KvPageHeldBytes; no RoPE table here), and the charge has
  // the spec the session keeps (some bytes); nothing is shared.
  const int64_t held = std::stoll(row[8]);
  int64_t page_tokens = 0;
  for (const int64_t p : {16, 32}) {
    if (held == KvPageHeldBytes(p * 32, p * 32)) page_tokens = p;
  }
  ASSERT_NE(page_tokens, 0) << r.out;
  EXPECT_GE(std::stoll(row[7]) - held * (64 / page_tokens), 0) << r.out;
  EXPECT_LT(std::stoll(row[7]) - held * (64 / page_tokens), 1024) << r.out;
  EXPECT_EQ(row[9], "0");
  EXPECT_EQ(row[1], "3");
  EXPECT_EQ(row[2], "64");
  EXPECT_EQ(row[3], "softmax");
  EXPECT_EQ(row[4], "bf16");
  EXPECT_EQ(row[5], "yes");

  r = Cli({"sessions", "--close", id});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("closed ", id)));
  r = Cli({"sessions"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, Not(HasSubstr(id)));

  r = Cli({"sessions", "--close", "00000000000000000000000000000000"});
  EXPECT_EQ(r.exit_code, 5) << Describe(r);
  ExpectOneErrorLine(r, "sessions", "NOT_FOUND");
  // An empty id is a usage error, not a listing.
  r = Cli({"sessions", "--close="});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  ExpectOneErrorLine(r, "sessions", "USAGE");
  EXPECT_THAT(r.err, HasSubstr("--close needs a session id"));
}

// --- attend. ---

std::vector<float> Floats(const v1::Tensor& t) {
  auto values = client::ToFloats(t);
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *values : std::vector<float>();
}

TEST_F(CliTest, AttendRandomWritesNpyEqualToALibraryCall) {
  const std::string out = Path("out.npy"), probs = Path("probs.npy");
  RunResult r = Cli({"attend", "--heads=4", "--kv_heads=2", "--head_dim=16", "--q_len=5",
                     "--k_len=7", "--causal", "--seed=7", "--rope_type=linear", "--rope_factor=2",
                     "--out", out, "--probs_out", probs});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("out      [1, 5, 4, 16] f32"));
  EXPECT_THAT(r.out, HasSubstr("finite yes"));
  EXPECT_THAT(r.out, HasSubstr("rope linear x2"));

  auto written = client::ReadNpy(out);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_THAT(written->shape(), ElementsAre(1, 5, 4, 16));
  EXPECT_EQ(written->dtype(), v1::DTYPE_F32);

  // The same request through the library: seeds seed, seed+1, seed+2.
  v1::AttendRequest request;
  auto* spec = request.mutable_spec();
  spec->set_heads(4);
  spec->set_kv_heads(2);
  spec->set_head_dim(16);
  spec->set_causal(true);
  spec->mutable_rope()->mutable_scaling()->set_rope_type("linear");
  spec->mutable_rope()->mutable_scaling()->set_factor(2);
  const int64_t q_shape[] = {1, 5, 4, 16}, kv_shape[] = {1, 7, 2, 16};
  *request.mutable_q() = *client::RandomTensor(v1::DTYPE_F32, q_shape, 7);
  *request.mutable_k() = *client::RandomTensor(v1::DTYPE_F32, kv_shape, 8);
  *request.mutable_v() = *client::RandomTensor(v1::DTYPE_F32, kv_shape, 9);
  auto expected = Client()->Attend(request);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::vector<float> got = Floats(*written), want = Floats(expected->out());
  ASSERT_EQ(got.size(), want.size());
  double mean = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-6) << i;
    mean += got[i];
  }
  mean /= got.size();
  EXPECT_NEAR(NumberAfter(r.out, "out ", "mean"), mean, 1e-5);

  auto p = client::ReadNpy(probs);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->shape(), ElementsAre(1, 4, 5, 7));
  std::vector<float> pv = Floats(*p);
  for (int row = 0; row < 4 * 5; ++row) {
    double sum = 0;
    for (int j = 0; j < 7; ++j) sum += pv[row * 7 + j];
    EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
  }
  // Causal with the queries last: query 0 (position 2) sees keys 0..2 only.
  EXPECT_EQ(pv[3], 0.0f);
}

// An omitted RoPE means no positional scheme in the CLI as in the API (the
// proto's AttentionSpec); --rope or any RoPE flag turns it on.
TEST_F(CliTest, RopeIsOffUnlessAskedForAsInTheApi) {
  const int64_t shape[] = {1, 4, 2, 8};
  v1::AttendRequest request;
  request.mutable_spec()->set_heads(2);
  request.mutable_spec()->set_head_dim(8);
  *request.mutable_q() = *client::RandomTensor(v1::DTYPE_F32, shape, 11);
  *request.mutable_k() = *client::RandomTensor(v1::DTYPE_F32, shape, 12);
  *request.mutable_v() = *client::RandomTensor(v1::DTYPE_F32, shape, 13);
  auto plain = Client()->Attend(request);  // no `rope`: no positional scheme
  ASSERT_TRUE(plain.ok()) << plain.status();
  request.mutable_spec()->mutable_rope();
  auto rotated = Client()->Attend(request);
  ASSERT_TRUE(rotated.ok()) << rotated.status();
  const std::vector<float> want_plain = Floats(plain->out()), want_rope = Floats(rotated->out());

  const auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"attend", "--heads=2", "--head_dim=8", "--q_len=4",
                                     "--k_len=4", "--seed=11", "--out", Path("o.npy")};
    args.insert(args.end(), extra.begin(), extra.end());
    RunResult r = Cli(args);
    EXPECT_EQ(r.exit_code, 0) << Describe(r);
    auto written = client::ReadNpy(Path("o.npy"));
    return written.ok() ? Floats(*written) : std::vector<float>();
  };
  const auto max_diff = [](const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size() || a.empty()) return 1e9;
    double d = 0;
    for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(double{a[i]} - b[i]));
    return d;
  };
  // The two answers differ, so matching one of them says which was computed.
  ASSERT_GT(max_diff(want_plain, want_rope), 1e-3);
  EXPECT_LT(max_diff(run({}), want_plain), 1e-6);
  EXPECT_LT(max_diff(run({"--rope"}), want_rope), 1e-6);
  EXPECT_LT(max_diff(run({"--theta=10000"}), want_rope), 1e-6);

  RunResult r = Cli({"attend", "--norope", "--theta=10000"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "attend", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, HasSubstr("--norope"));
  r = Cli({"attend", "--alibi", "--rope"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "attend", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, HasSubstr("--alibi"));
}

// .npy inputs were read whole before their header was checked (a 3 GiB file
// that is not .npy: 4.2 GB of RSS; /dev/zero until killed). Now the header
// comes first: errors name the flag and the file, and a file whose tensor
// is more than --max_message_bytes is refused before its data is read.
TEST_F(CliTest, NpyInputsAreCheckedFromTheirHeaderNamingTheFlag) {
  const std::string junk = Path("junk.npy");
  std::ofstream(junk, std::ios::binary) << "this is not a .npy file";
  RunResult r = Cli({"attend", "--q", junk, "--k", junk, "--v", junk});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "attend", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--q: ", junk, ": not a usable .npy file: it does "
                                            "not start with the magic")));
  r = Cli({"encode", "--op=rope_apply", "--x", junk});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--x: ", junk, ": not a usable")));

  // [1, 64, 8, 64] f32 = 131072 bytes, over a 65536-byte limit.
  const std::string big = Path("big.npy");
  const int64_t shape[] = {1, 64, 8, 64};
  ASSERT_TRUE(client::WriteNpy(big, *client::RandomTensor(v1::DTYPE_F32, shape, 1)).ok());
  const std::string small = Path("small.npy");
  const int64_t small_shape[] = {1, 4, 8, 64};
  ASSERT_TRUE(client::WriteNpy(small, *client::RandomTensor(v1::DTYPE_F32, small_shape, 1)).ok());
  r = Cli({"attend", "--q", small, "--k", big, "--v", small, "--max_message_bytes=65536"});
  EXPECT_EQ(r.exit_code, 8) << Describe(r);
  ExpectOneErrorLine(r, "attend", "RESOURCE_EXHAUSTED");
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--k: ", big, ": shape (1, 64, 8, 64) of '<f4' is "
                                            "131072 bytes, more than --max_message_bytes 65536; "
                                            "not read")));
  r = Cli({"attend", "--model=demo", "--hidden", big, "--max_message_bytes=65536"});
  EXPECT_EQ(r.exit_code, 8) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--hidden: ", big, ": shape")));
  // decode sends its inputs in slices: the whole file may exceed the limit.
  r = Cli({"decode", "--q", big, "--k", big, "--v", big, "--context=60", "--steps=4",
           "--prefill_chunk=4", "--max_message_bytes=65536"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);

  // A file of the wrong rank or, for decode, batch or length: the flag and the file.
  const std::string rank3 = Path("rank3.npy");
  const int64_t rank3_shape[] = {4, 8, 64};
  ASSERT_TRUE(client::WriteNpy(rank3, *client::RandomTensor(v1::DTYPE_F32, rank3_shape, 1)).ok());
  for (const char* command : {"attend", "decode", "plot"}) {
    std::vector<std::string> args = {command, "--q", rank3, "--k", small, "--v", small};
    if (std::string(command) == "decode") args.insert(args.end(), {"--context=1", "--steps=1"});
    if (std::string(command) == "plot")
      args.insert(args.end(), {"--kind=attention", "--out", Path("r.svg")});
    r = Cli(args);
    EXPECT_EQ(r.exit_code, 3) << command << "\n" << Describe(r);
    ExpectOneErrorLine(r, command, "INVALID_ARGUMENT");
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--q: ", rank3,
                                              ": must have rank 4 [batch, seq, "
                                              "heads, dim], got [4, 8, 64] f32")))
        << command;
  }
  r = Cli({"decode", "--q", small, "--k", small, "--v", small, "--context=4", "--steps=1"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--q: ", small,
                                            ": must be [1, >= 5, heads, dim], got [1, 4, "
                                            "8, 64] f32")));
}

// The probabilities were written over the output.
TEST_F(CliTest, AttendRefusesOutAndProbsOutNamingTheSameFile) {
  const std::string out = Path("same.npy");
  const std::string dir = out.substr(0, out.rfind('/'));
  for (const std::string& probs : {out, absl::StrCat(dir, "/./same.npy")}) {
    for (bool layer : {false, true}) {
      std::vector<std::string> args = {"attend", "--q_len=4", "--out", out, "--probs_out", probs};
      if (layer) {
        args.insert(args.end(), {"--model=demo", "--layer=0"});
      } else {
        args.insert(args.end(), {"--heads=2", "--head_dim=8"});
      }
      RunResult r = Cli(args);
      EXPECT_EQ(r.exit_code, 64) << Describe(r);
      ExpectOneErrorLine(r, "attend", "USAGE");
      EXPECT_THAT(r.err,
                  HasSubstr(absl::StrCat("--out and --probs_out name the same file ", probs)));
      // Refused before anything is written.
      std::ifstream written(out);
      EXPECT_FALSE(written.good()) << probs;
    }
  }
  RunResult r = Cli({"attend", "--q_len=4", "--heads=2", "--head_dim=8", "--out", out,
                     "--probs_out", Path("probs.npy")});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = Cli({"attend", "--q_len=4", "--heads=2", "--head_dim=8", "--out", out, "--probs_out",
           absl::StrCat(dir, "/../", dir.substr(dir.rfind('/') + 1), "/same.npy")});
  EXPECT_EQ(r.exit_code, 64) << "an existing file, by another path\n" << Describe(r);
}

TEST_F(CliTest, AttendReadsNpyInputs) {
  const int64_t q_shape[] = {2, 3, 2, 8}, kv_shape[] = {2, 4, 1, 8};
  v1::AttendRequest request;
  *request.mutable_q() = *client::RandomTensor(v1::DTYPE_BF16, q_shape, 100);
  *request.mutable_k() = *client::RandomTensor(v1::DTYPE_BF16, kv_shape, 200);
  *request.mutable_v() = *client::RandomTensor(v1::DTYPE_BF16, kv_shape, 300);
  ASSERT_TRUE(client::WriteNpy(Path("q.npy"), request.q()).ok());
  ASSERT_TRUE(client::WriteNpy(Path("k.npy"), request.k()).ok());
  ASSERT_TRUE(client::WriteNpy(Path("v.npy"), request.v()).ok());
  RunResult r = Cli({"attend", "--q", Path("q.npy"), "--k", Path("k.npy"), "--v", Path("v.npy"),
                     "--norope", "--out", Path("o.npy")});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("k        [2, 4, 1, 8] bf16"));
  EXPECT_THAT(r.out, HasSubstr("heads 2 kv_heads 1 head_dim 8"));
  EXPECT_THAT(r.out, HasSubstr("no positional encoding"));

  request.mutable_spec()->set_heads(2);
  request.mutable_spec()->set_kv_heads(1);
  request.mutable_spec()->set_head_dim(8);
  auto expected = Client()->Attend(request);
  ASSERT_TRUE(expected.ok()) << expected.status();
  auto written = client::ReadNpy(Path("o.npy"));
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_THAT(written->shape(), ElementsAre(2, 3, 2, 8));
  EXPECT_EQ(Floats(*written), Floats(expected->out()));

  r = Cli({"attend", "--q", Path("missing.npy"), "--k", Path("k.npy"), "--v", Path("v.npy")});
  EXPECT_EQ(r.exit_code, 5) << Describe(r);
  ExpectOneErrorLine(r, "attend", "NOT_FOUND");
  // The random inputs' flags mean nothing with files: refused, not ignored.
  for (const char* flag :
       {"--q_len=5", "--batch=3", "--k_len=7", "--dtype=bf16", "--seed=9", "--v_dim=8"}) {
    r = Cli({"attend", "--q", Path("q.npy"), "--k", Path("k.npy"), "--v", Path("v.npy"),
             "--norope", flag});
    EXPECT_EQ(r.exit_code, 64) << flag << " " << Describe(r);
    EXPECT_THAT(r.err, HasSubstr("is not read by attend with --q/--k/--v")) << flag;
  }
}

TEST_F(CliTest, AttendErrorsMapToTheirStatusCode) {
  RunResult r = Cli({"attend", "--heads", "6", "--kv_heads", "4"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "attend", "INVALID_ARGUMENT");
  EXPECT_EQ(r.out, "");

  r = Cli({"attend", "--rope_type=bogus"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "attend", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, HasSubstr("bogus"));

  r = Cli({"attend", "--dtype=f16"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "attend", "INVALID_ARGUMENT");
}

// --- encode. ---

TEST_F(CliTest, EncodeRopeFrequencies) {
  RunResult r = Cli({"encode", "--op=rope_frequencies", "--head_dim=8", "--out", Path("f.npy")});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  std::vector<double> printed;
  for (absl::string_view line : absl::StrSplit(r.out, '\n')) {
    if (!absl::ConsumePrefix(&line, "inv_freq ")) continue;
    for (absl::string_view word : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      double v;
      ASSERT_TRUE(absl::SimpleAtod(word, &v)) << word;
      printed.push_back(v);
    }
  }
  ASSERT_EQ(printed.size(), 4u) << r.out;
  auto written = client::ReadNpy(Path("f.npy"));
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_THAT(written->shape(), ElementsAre(4));
  std::vector<float> values = Floats(*written);
  for (int i = 0; i < 4; ++i) {
    const double expected = std::pow(10000.0, -2.0 * i / 8);
    EXPECT_NEAR(printed[i], expected, 1e-8 * expected) << i;
    EXPECT_NEAR(values[i], expected, 1e-6 * expected) << i;
  }
}

TEST_F(CliTest, EncodeSinusoidalCosSinAndAlibi) {
  RunResult r = Cli(
      {"encode", "--op=sinusoidal", "--num_positions=10", "--d_model=6", "--out", Path("t.npy")});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto table = client::ReadNpy(Path("t.npy"));
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_THAT(table->shape(), ElementsAre(10, 6));
  std::vector<float> t = Floats(*table);
  EXPECT_NEAR(t[6 * 1 + 0], std::sin(1.0), 1e-6);  // interleaved: sin at 2i
  EXPECT_NEAR(t[6 * 1 + 1], std::cos(1.0), 1e-6);  // cos at 2i + 1
  EXPECT_NEAR(t[6 * 7 + 2], std::sin(7 * std::pow(10000.0, -2.0 / 6)), 1e-6);

  r = Cli(
      {"encode", "--op=rope_cos_sin", "--head_dim=8", "--positions=0,3", "--out", Path("cs.npy")});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto cos = client::ReadNpy(Path("cs.npy"));
  auto sin = client::ReadNpy(Path("cs_sin.npy"));
  ASSERT_TRUE(cos.ok() && sin.ok()) << cos.status() << sin.status();
  EXPECT_THAT(cos->shape(), ElementsAre(2, 4));
  EXPECT_THAT(sin->shape(), ElementsAre(2, 4));
  EXPECT_NEAR(Floats(*cos)[4 + 1], std::cos(3 * 0.1), 1e-6);
  EXPECT_NEAR(Floats(*sin)[4 + 1], std::sin(3 * 0.1), 1e-6);

  r = Cli({"encode", "--op=alibi", "--heads=4"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("slopes 0.25 0.0625 0.015625 0.00390625\n"));

  r = Cli({"encode", "--op=rope_apply", "--heads=2", "--head_dim=8", "--q_len=3", "--out",
           Path("x.npy")});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto x = client::ReadNpy(Path("x.npy"));
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_THAT(x->shape(), ElementsAre(1, 3, 2, 8));
  // Position 0 is not rotated.
  const int64_t shape[] = {1, 3, 2, 8};
  std::vector<float> in = Floats(*client::RandomTensor(v1::DTYPE_F32, shape, 1));
  std::vector<float> rotated = Floats(*x);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(rotated[i], in[i], 1e-6) << i;

  r = Cli({"encode", "--op=sinusoidal", "--d_model=7"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "encode", "INVALID_ARGUMENT");

  // Each op's own flags are read, not refused: the alibi bias's, t5's, and
  // rope_apply's with an --x file.
  r = Cli({"encode", "--op=alibi", "--heads=2", "--q_len=2", "--k_len=3", "--q_offset=1",
           "--bidirectional"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("bias     [2, 2, 3] f32"));
  r = Cli({"encode", "--op=t5", "--q_len=2", "--k_len=3", "--q_offset=1", "--bidirectional",
           "--num_buckets=8", "--t5_max_distance=16"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  r = Cli({"encode", "--op=rope_apply", "--x", Path("x.npy"), "--offsets=2", "--inverse",
           "--theta=500", "--seq_len=8"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
}

// --- decode. ---

TEST_F(CliTest, DecodeLastStepEqualsOneShotAttend) {
  RunResult r = Cli({"decode", "--steps=3", "--context=5", "--prefill_chunk=2", "--heads=2",
                     "--head_dim=8", "--seed=3", "--rope", "--out", Path("last.npy")});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("prefill  5 tokens in 3 chunks"));
  for (int step = 1; step <= 3; ++step) {
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("step    ", step, "  position      ", 5 + step)));
  }
  EXPECT_GT(NumberAfter(r.out, "steps 3", "p50"), 0);
  EXPECT_GE(NumberAfter(r.out, "steps 3", "p99"), NumberAfter(r.out, "steps 3", "p50"));

  auto last = client::ReadNpy(Path("last.npy"));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_THAT(last->shape(), ElementsAre(1, 1, 2, 8));

  v1::AttendRequest request;
  request.mutable_spec()->set_heads(2);
  request.mutable_spec()->set_head_dim(8);
  request.mutable_spec()->set_causal(true);
  request.mutable_spec()->mutable_rope();
  const int64_t shape[] = {1, 8, 2, 8};
  *request.mutable_q() = *client::RandomTensor(v1::DTYPE_F32, shape, 3);
  *request.mutable_k() = *client::RandomTensor(v1::DTYPE_F32, shape, 4);
  *request.mutable_v() = *client::RandomTensor(v1::DTYPE_F32, shape, 5);
  auto expected = Client()->Attend(request);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::vector<float> want = Floats(expected->out()), got = Floats(*last);
  ASSERT_EQ(want.size(), 8u * 16u);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(got[i], want[7 * 16 + i], 1e-5) << i;
}

TEST_F(CliTest, DecodeStepPastMaxContextIsOutOfRange) {
  RunResult r = Cli({"decode", "--steps=4", "--heads=2", "--head_dim=8", "--max_context=2"});
  EXPECT_EQ(r.exit_code, 11) << Describe(r);
  ExpectOneErrorLine(r, "decode", "OUT_OF_RANGE");
}

// --- plot. ---

TEST_F(CliTest, PlotDecayMatchesTheRoFormerBound) {
  const std::string svg = Path("decay.svg");
  RunResult r = Cli({"plot", "--kind=decay", "--head_dim=64", "--max_distance=200",
                     "--config=rope:default:1:10000", "--config", "base 500k <&>:default:1:500000",
                     "--out", svg});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto root = ParseSvgFile(svg);
  ASSERT_NE(root, nullptr);

  auto titles = root->All("text", "title");
  ASSERT_EQ(titles.size(), 1u);
  EXPECT_THAT(titles[0]->text, HasSubstr("decay"));
  ASSERT_EQ(root->All("text", "xlabel").size(), 1u);
  EXPECT_THAT(root->All("text", "xlabel")[0]->text, HasSubstr("distance"));
  ASSERT_EQ(root->All("text", "ylabel").size(), 1u);
  EXPECT_THAT(root->All("text", "ylabel")[0]->text, HasSubstr("bound"));
  std::vector<std::string> legend;
  for (const XmlNode* t : root->All("text", "legend-label")) legend.push_back(t->text);
  EXPECT_THAT(legend, ElementsAre("rope", "base 500k <&>"));

  Axis x = ReadAxis(*root, "xtick", false);
  Axis y = ReadAxis(*root, "ytick", false);
  auto series = root->All("polyline", "series");
  ASSERT_EQ(series.size(), 2u);
  EXPECT_EQ(series[0]->attrs.at("data-series"), "rope");
  auto points = ParsePoints(series[0]->attrs.at("points"));
  ASSERT_EQ(points.size(), 201u);
  // Coordinates have 3 decimals: over a y range of a few tens on ~400 px,
  // that is ~1e-4 in data units; 2e-3 leaves room for the tick rounding.
  constexpr double kTolerance = 2e-3;
  for (int distance : {0, 1, 2, 10, 37, 100, 200}) {
    const auto& [px, py] = points[distance];
    EXPECT_NEAR(x.ToValue(px), distance, 1e-3);
    EXPECT_NEAR(y.ToValue(py), ReferenceDecayBound(64, 10000, distance), kTolerance)
        << "distance " << distance;
  }
  // At distance 0 every |S_j| = j: the bound is (d/2 + 1) / 2.
  EXPECT_NEAR(y.ToValue(points[0].second), 16.5, kTolerance);
  // The second curve uses its own base.
  auto points2 = ParsePoints(series[1]->attrs.at("points"));
  ASSERT_EQ(points2.size(), 201u);
  EXPECT_NEAR(y.ToValue(points2[100].second), ReferenceDecayBound(64, 500000, 100), kTolerance);
}

TEST_F(CliTest, PlotWavelengthUsesALogAxis) {
  const std::string svg = Path("wavelength.svg");
  RunResult r = Cli({"plot", "--kind=wavelength", "--head_dim=32", "--config=base:default",
                     "--config=pi:linear:4:10000", "--out", svg});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto root = ParseSvgFile(svg);
  ASSERT_NE(root, nullptr);
  Axis y = ReadAxis(*root, "ytick", /*log=*/true);
  for (double v : y.values) {
    EXPECT_NEAR(std::log10(v), std::round(std::log10(v)), 1e-9) << "log ticks are powers of 10";
  }
  Axis x = ReadAxis(*root, "xtick", false);
  auto series = root->All("polyline", "series");
  ASSERT_EQ(series.size(), 2u);
  EXPECT_EQ(root->All("text", "legend-label").size(), 2u);
  auto base = ParsePoints(series[0]->attrs.at("points"));
  auto linear = ParsePoints(series[1]->attrs.at("points"));
  ASSERT_EQ(base.size(), 16u);
  ASSERT_EQ(linear.size(), 16u);
  for (int i : {0, 5, 15}) {
    const double wavelength = 2 * M_PI / std::pow(10000.0, -2.0 * i / 32);
    EXPECT_NEAR(x.ToValue(base[i].first), i, 1e-3);
    EXPECT_NEAR(y.ToValue(base[i].second), wavelength, 1e-3 * wavelength) << i;
    // Position interpolation stretches every wavelength by the factor.
    EXPECT_NEAR(y.ToValue(linear[i].second), 4 * wavelength, 4e-3 * wavelength) << i;
  }
}

// --original_max_positions goes to the configs whose rule reads an L0 (the
// server refuses one under default, linear and ntk); it replaces the built-in
// yarn and llama3 L0s.
TEST_F(CliTest, PlotOriginalMaxPositionsOnlyForRulesWithAnL0) {
  auto series_points = [&](const std::string& svg) {
    std::map<std::string, std::string> points;
    auto root = ParseSvgFile(svg);
    if (root == nullptr) return points;
    for (const XmlNode* s : root->All("polyline", "series")) {
      points[s->attrs.at("data-series")] = s->attrs.at("points");
    }
    return points;
  };
  const std::string plain = Path("l0_plain.svg"), l0 = Path("l0_4096.svg");
  RunResult r = Cli({"plot", "--kind=wavelength", "--head_dim=32", "--out", plain});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  r = Cli({"plot", "--kind=decay", "--head_dim=32", "--original_max_positions=4096", "--out", l0});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  r = Cli({"plot", "--kind=wavelength", "--head_dim=32", "--original_max_positions=4096", "--out",
           l0});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  std::map<std::string, std::string> a = series_points(plain), b = series_points(l0);
  ASSERT_EQ(a.size(), 5u);
  ASSERT_EQ(b.size(), 5u);
  EXPECT_EQ(a.at("default"), b.at("default"));
  EXPECT_NE(a.at("yarn x4"), b.at("yarn x4")) << "yarn's L0 is the flag's, not 2048";

  r = Cli({"plot", "--kind=decay", "--head_dim=32", "--max_distance=50",
           "--original_max_positions=4096", "--config=d:default:1:10000",
           "--config=n:ntk:4:10000", "--config=y:yarn:4:10000", "--out", l0});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(series_points(l0).size(), 3u);
}

TEST_F(CliTest, PlotSinusoidalHeatmap) {
  const std::string svg = Path("sin.svg");
  RunResult r =
      Cli({"plot", "--kind=sinusoidal", "--num_positions=20", "--d_model=16", "--out", svg});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto root = ParseSvgFile(svg);
  ASSERT_NE(root, nullptr);
  auto cells = root->All("g", "cells");
  ASSERT_EQ(cells.size(), 1u);
  EXPECT_EQ(cells[0]->All("rect").size(), 20u * 16u);
  ASSERT_EQ(root->All("g", "colorbar").size(), 1u);
  EXPECT_GE(root->All("line", "ctick").size(), 3u);
  EXPECT_EQ(root->All("text", "title").size(), 1u);
  ReadAxis(*root, "xtick", false);
  ReadAxis(*root, "ytick", false);
  // Row 0 (position 0): sin 0 = 0 (white, the middle of the diverging map),
  // cos 0 = 1 (the red end).
  auto rects = cells[0]->All("rect");
  EXPECT_EQ(rects[0]->attrs.at("fill"), "#f7f7f7");
  EXPECT_EQ(rects[1]->attrs.at("fill"), "#b2182b");
}

TEST_F(CliTest, PlotAttentionHeatmapOfOneHead) {
  const std::string svg = Path("attention.svg");
  RunResult r = Cli({"plot", "--kind=attention", "--q_len=6", "--heads=2", "--head_dim=8",
                     "--causal", "--head=1", "--out", svg});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto root = ParseSvgFile(svg);
  ASSERT_NE(root, nullptr);
  auto cells = root->All("g", "cells");
  ASSERT_EQ(cells.size(), 1u);
  auto rects = cells[0]->All("rect");
  ASSERT_EQ(rects.size(), 36u);
  // Causal: query 0 sees only key 0 (probability 1, the top of the scale);
  // the masked keys are 0 (the bottom).
  EXPECT_EQ(rects[0]->attrs.at("fill"), "#fde725");
  EXPECT_EQ(rects[5]->attrs.at("fill"), "#440154");
  EXPECT_THAT(root->All("text", "title")[0]->text, HasSubstr("head 1"));

  r = Cli({"plot", "--kind=attention", "--heads=2", "--head=2", "--out", svg});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "plot", "INVALID_ARGUMENT");
}

TEST_F(CliTest, PlotErrors) {
  RunResult r = Cli({"plot", "--kind=pie", "--out", Path("x.svg")});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  ExpectOneErrorLine(r, "plot", "USAGE");
  r = Cli({"plot", "--kind=decay"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  r = Cli({"plot", "--kind=decay", "--config=x:nonsense_rule:1:10000", "--out", Path("x.svg")});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "plot", "INVALID_ARGUMENT");
  r = Cli({"plot", "--kind=decay", "--out", Path("no/such/dir/x.svg")});
  EXPECT_EQ(r.exit_code, 5) << Describe(r);
  ExpectOneErrorLine(r, "plot", "NOT_FOUND");
}

// A flag the --kind does not read is refused, naming the flag and the kind;
// under decay and wavelength each --config sets its curve's rule, factor and
// theta, so the RoPE flags that would set them are refused naming the config.
TEST_F(CliTest, PlotRefusesFlagsTheKindDoesNotRead) {
  const std::string svg = Path("unread.svg");
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> named;
  };
  const Case cases[] = {
      {{"--kind=sinusoidal", "--num_positions=8", "--d_model=8", "--causal"},
       {"--causal", "plot --kind sinusoidal"}},
      {{"--kind=sinusoidal", "--num_positions=8", "--d_model=8", "--q_len=5"},
       {"--q_len", "plot --kind sinusoidal"}},
      {{"--kind=decay", "--head_dim=64", "--config=n:ntk:4", "--theta=500000"},
       {"--theta", "plot --kind decay", "--config \"n:ntk:4\""}},
      {{"--kind=decay", "--head_dim=64", "--theta=500000"},
       {"--theta", "plot --kind decay", "built-in --config"}},
      {{"--kind=wavelength", "--head_dim=64", "--config=d:default", "--rope_factor=4"},
       {"--rope_factor", "plot --kind wavelength", "--config \"d:default\""}},
      {{"--kind=wavelength", "--head_dim=64", "--rope_layout=interleaved"},
       {"--rope_layout", "plot --kind wavelength"}},
      {{"--kind=wavelength", "--head_dim=64", "--config=d:default",
        "--original_max_positions=4096"},
       {"--original_max_positions", "--config \"d:default\""}},
      {{"--kind=decay", "--head_dim=64", "--config=y:yarn:4:10000:2048",
        "--original_max_positions=4096"},
       {"--original_max_positions", "--config \"y:yarn:4:10000:2048\""}},
      {{"--kind=attention", "--q_len=8", "--max_distance=100"},
       {"--max_distance", "plot --kind attention"}},
      {{"--kind=attention", "--q_len=8", "--d_model=32"}, {"--d_model", "plot --kind attention"}},
      {{"--kind=attention", "--config=d:default"}, {"--config", "plot --kind attention"}},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"plot", "--out", svg};
    args.insert(args.end(), c.args.begin(), c.args.end());
    RunResult r = Cli(args);
    EXPECT_EQ(r.exit_code, 64) << absl::StrJoin(c.args, " ") << "\n" << Describe(r);
    ExpectOneErrorLine(r, "plot", "USAGE");
    for (const std::string& name : c.named) {
      EXPECT_THAT(r.err, HasSubstr(name)) << absl::StrJoin(c.args, " ");
    }
  }
  // What each kind reads is still accepted.
  for (std::vector<std::string> args : {
           std::vector<std::string>{"--kind=decay", "--head_dim=32", "--max_distance=20",
                                    "--seq_len=64", "--rotary_dim=16", "--title=t"},
           std::vector<std::string>{"--kind=sinusoidal", "--num_positions=8", "--d_model=8",
                                    "--base=100", "--sin_layout=sin_cos_half",
                                    "--first_position=3"},
           std::vector<std::string>{"--kind=attention", "--q_len=4", "--k_len=6", "--heads=2",
                                    "--head_dim=8", "--causal", "--theta=500000", "--head=1",
                                    "--seed=3", "--dtype=bf16"},
       }) {
    args.insert(args.begin(), {"plot", "--out", svg});
    RunResult r = Cli(args);
    EXPECT_EQ(r.exit_code, 0) << absl::StrJoin(args, " ") << "\n" << Describe(r);
  }
}

// --- models, embed and layer mode. ---

// Norm-wise relative error ||a - b|| / ||b||.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

TEST_F(CliTest, ModelCommandsAndLayerFlagsAreInHelp) {
  RunResult r = RunCli({"--help"});
  EXPECT_THAT(r.out, AllOf(HasSubstr("  models "), HasSubstr("  embed ")));
  const std::vector<std::pair<const char*, std::vector<const char*>>> cases = {
      {"models", {"--json", "--name"}},
      {"embed", {"--model", "--tokens", "--shape", "--offsets", "--dtype", "--out"}},
      {"attend", {"--model", "--layer", "--hidden", "--offsets"}},
      {"decode", {"--model", "--layer", "--hidden"}},
      {"bench", {"--model", "--layer"}},
  };
  for (const auto& [command, flags] : cases) {
    r = RunCli({command, "--help"});
    EXPECT_EQ(r.exit_code, 0) << command << "\n" << Describe(r);
    for (const char* flag : flags) EXPECT_THAT(r.out, HasSubstr(flag)) << command;
  }
  r = RunCli({"models", "--help"});
  EXPECT_THAT(r.out, Not(HasSubstr("--heads")));
}

TEST_F(CliTest, ModelsTableJsonAndDetail) {
  RunResult r = Cli({"models"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  std::vector<std::string> lines = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << r.out;  // header, demo, count
  EXPECT_THAT(lines[0], AllOf(StartsWith("NAME"), HasSubstr("HIDDEN"), HasSubstr("ROPE"),
                              HasSubstr("MEMORY")));
  std::vector<std::string> words = absl::StrSplit(lines[1], ' ', absl::SkipEmpty());
  ASSERT_GE(words.size(), 11u) << lines[1];
  EXPECT_EQ(words[0], "demo");
  EXPECT_EQ(words[1], "built-in");
  EXPECT_EQ(words[2], "ropeattn-demo");
  EXPECT_EQ(words[3], "128");   // hidden
  EXPECT_EQ(words[4], "8/2");   // heads / kv heads
  EXPECT_EQ(words[5], "16");    // head_dim
  EXPECT_EQ(words[6], "256");   // vocab
  EXPECT_EQ(words[7], "2");     // layers
  EXPECT_EQ(words[8], "4096");  // max positions
  EXPECT_EQ(words[9], "rope");
  EXPECT_EQ(words[10], "llama3");
  EXPECT_THAT(lines[1], HasSubstr("x8 (af 1)"));
  EXPECT_EQ(lines[2], "1 model");

  r = Cli({"models", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, AllOf(HasSubstr("\"name\": \"demo\""), HasSubstr("\"hidden_size\": \"128\""),
                           HasSubstr("\"kv_heads\": \"2\""), HasSubstr("\"inv_freq\"")));

  r = Cli({"models", "--name", "demo"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto info = Client()->GetModel("demo");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(r.out,
              AllOf(HasSubstr("hidden_size        128\n"),
                    HasSubstr("heads              8 query, 2 kv (group 4)\n"),
                    HasSubstr("layers             2\n"), HasSubstr("positions          rope\n"),
                    HasSubstr("rope               llama3 factor 8 theta 500000"),
                    HasSubstr("L0 1024"), HasSubstr("attention_factor   1\n")));
  // The summary of the inverse frequencies matches the server's list.
  EXPECT_DOUBLE_EQ(NumberAfter(r.out, "inv_freq ", "first"), info->inv_freq(0));
  EXPECT_NEAR(NumberAfter(r.out, "inv_freq ", "last"), info->inv_freq(7), 1e-14);
  EXPECT_THAT(r.out, HasSubstr("inv_freq           8 pairs"));

  r = Cli({"models", "--name", "demo", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, StartsWith("{"));
  EXPECT_THAT(r.out, HasSubstr("\"rope_type\": \"llama3\""));

  r = Cli({"models", "--name", "nope"});
  EXPECT_EQ(r.exit_code, 5) << Describe(r);
  ExpectOneErrorLine(r, "models", "NOT_FOUND");
  EXPECT_THAT(r.err, HasSubstr("nope"));
}

TEST_F(CliTest, EmbedWritesTheLibrarysEmbeddings) {
  const std::string out = Path("emb.npy");
  RunResult r =
      Cli({"embed", "--model", "demo", "--tokens", "3,4,3,200", "--shape", "2,2", "--out", out});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, AllOf(HasSubstr("out      [2, 2, 128] f32"), HasSubstr("tokens   4 ids")));
  auto written = client::ReadNpy(out);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_THAT(written->shape(), ElementsAre(2, 2, 128));

  v1::EmbedRequest request;
  request.set_model("demo");
  for (int64_t id : {3, 4, 3, 200}) request.add_token_ids(id);
  request.add_shape(2);
  request.add_shape(2);
  auto expected = Client()->Embed(request);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(written->data(), expected->embeddings().data());  // bit-exact
  const std::vector<float> v = Floats(*written);
  EXPECT_TRUE(std::equal(v.begin(), v.begin() + 128, v.begin() + 256));   // id 3 twice
  EXPECT_FALSE(std::equal(v.begin(), v.begin() + 128, v.begin() + 128));  // 3 vs 4

  r = Cli({"embed", "--model", "demo", "--tokens", "1,300"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);
  ExpectOneErrorLine(r, "embed", "INVALID_ARGUMENT");
  EXPECT_THAT(r.err, AllOf(HasSubstr("300"), HasSubstr("token_ids[1]")));

  r = Cli({"embed", "--tokens", "1"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  ExpectOneErrorLine(r, "embed", "USAGE");
}

TEST_F(CliTest, LayerModeAttendEqualsTheLibraryCall) {
  const std::string out = Path("layer.npy");
  RunResult r = Cli({"attend", "--model", "demo", "--layer", "1", "--batch", "2", "--q_len", "6",
                     "--causal", "--seed", "11", "--out", out});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out,
              AllOf(HasSubstr("model    demo layer 1"), HasSubstr("hidden   [2, 6, 128] f32"),
                    HasSubstr("out      [2, 6, 128] f32")));
  auto written = client::ReadNpy(out);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_THAT(written->shape(), ElementsAre(2, 6, 128));

  v1::AttendRequest request;
  request.mutable_spec()->set_causal(true);
  request.mutable_layer()->set_model("demo");
  request.mutable_layer()->set_layer(1);
  const int64_t shape[] = {2, 6, 128};
  *request.mutable_layer()->mutable_hidden() = *client::RandomTensor(v1::DTYPE_F32, shape, 11);
  auto expected = Client()->Attend(request);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(written->data(), expected->out().data());  // bit-exact

  // The layer index matters: layer 0 gives other outputs.
  request.mutable_layer()->set_layer(0);
  auto layer0 = Client()->Attend(request);
  ASSERT_TRUE(layer0.ok()) << layer0.status();
  EXPECT_NE(written->data(), layer0->out().data());

  // Hidden states from a file: the same as the library call on them.
  const std::string hidden_path = Path("hidden.npy");
  const int64_t hshape[] = {1, 5, 128};
  auto hidden = client::RandomTensor(v1::DTYPE_F32, hshape, 99);
  ASSERT_TRUE(client::WriteNpy(hidden_path, *hidden).ok());
  r = Cli({"attend", "--model=demo", "--layer=0", "--hidden", hidden_path, "--out", out});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  // Without --causal the model's masking is computed (demo is causal): the
  // spec line said "bidirectional".
  EXPECT_THAT(r.out, AllOf(HasSubstr("spec     the model's masking"),
                           Not(HasSubstr("bidirectional"))));
  written = client::ReadNpy(out);
  ASSERT_TRUE(written.ok()) << written.status();
  request.mutable_spec()->set_causal(false);
  *request.mutable_layer()->mutable_hidden() = *hidden;
  expected = Client()->Attend(request);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(written->data(), expected->out().data());

  r = Cli({"attend", "--model", "demo", "--layer", "2"});
  EXPECT_EQ(r.exit_code, 11) << Describe(r);
  ExpectOneErrorLine(r, "attend", "OUT_OF_RANGE");
  r = Cli({"attend", "--model", "nope"});
  EXPECT_EQ(r.exit_code, 5) << Describe(r);
  ExpectOneErrorLine(r, "attend", "NOT_FOUND");
  r = Cli({"attend", "--model", "demo", "--heads", "4"});
  EXPECT_EQ(r.exit_code, 64) << Describe(r);
  ExpectOneErrorLine(r, "attend", "USAGE");
}

TEST_F(CliTest, LayerModeDecodeLastStepEqualsOneShotAttend) {
  // Token by token (no prefill), then with a chunked prefill.
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--context=0", "--steps=6"},
        std::vector<std::string>{"--context=4", "--prefill_chunk=3", "--steps=2"}}) {
    std::vector<std::string> args = {"decode", "--model", "demo",  "--layer",       "1",
                                     "--seed", "4",       "--out", Path("last.npy")};
    args.insert(args.end(), extra.begin(), extra.end());
    RunResult r = Cli(args);
    ASSERT_EQ(r.exit_code, 0) << Describe(r);
    EXPECT_THAT(r.out, HasSubstr("spec     model demo layer 1 causal"));
    EXPECT_THAT(r.out, HasSubstr("position      6"));
    auto last = client::ReadNpy(Path("last.npy"));
    ASSERT_TRUE(last.ok()) << last.status();
    ASSERT_THAT(last->shape(), ElementsAre(1, 1, 128));

    v1::AttendRequest request;
    request.mutable_spec()->set_causal(true);
    request.mutable_layer()->set_model("demo");
    request.mutable_layer()->set_layer(1);
    const int64_t shape[] = {1, 6, 128};
    *request.mutable_layer()->mutable_hidden() = *client::RandomTensor(v1::DTYPE_F32, shape, 4);
    auto expected = Client()->Attend(request);
    ASSERT_TRUE(expected.ok()) << expected.status();
    const std::vector<float> want = Floats(expected->out());
    const std::vector<float> last_row(want.begin() + 5 * 128, want.end());
    EXPECT_LT(RelativeError(Floats(*last), last_row), 1e-5);
    // And not the row before it (the comparison can tell positions apart).
    const std::vector<float> prev_row(want.begin() + 4 * 128, want.begin() + 5 * 128);
    EXPECT_GT(RelativeError(Floats(*last), prev_row), 1e-2);
  }

  RunResult r = Cli({"decode", "--model", "demo", "--layer", "1", "--steps", "2", "--hidden",
                     Path("missing.npy")});
  EXPECT_EQ(r.exit_code, 5) << Describe(r);
  ExpectOneErrorLine(r, "decode", "NOT_FOUND");
}

// --- TLS, tokens and mutual TLS against real servers. ---

// A server with TLS and a tokens file, and one with mutual TLS, for the suite.
class CliTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<testing::TlsMaterial> m = testing::MakeTlsMaterial("ropeattn_cli_tls_");
    ASSERT_TRUE(m.ok()) << m.status();
    material_ = new testing::TlsMaterial(*std::move(m));
    tokens_server_ =
        testing::StartTestServer(testing::TlsServerOptions(*material_, false, true)).release();
    mtls_server_ =
        testing::StartTestServer(testing::TlsServerOptions(*material_, true, false)).release();
  }
  static void TearDownTestSuite() {
    delete tokens_server_;
    delete mtls_server_;
    delete material_;
    tokens_server_ = mtls_server_ = nullptr;
    material_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(tokens_server_, nullptr);
    ASSERT_NE(mtls_server_, nullptr);
  }

  static std::string Target(const server::Server* server) {
    return absl::StrCat("--target=127.0.0.1:", server->port());
  }
  static std::string Ca() { return absl::StrCat("--tls_ca_file=", material_->ca_file); }
  // `ropeattn <args[0]> --target=<tokens server> --tls_ca_file=<ca> <args[1..]>`.
  static RunResult TokensCli(std::vector<std::string> args,
                             const std::vector<std::string>& env = {}) {
    args.insert(args.begin() + 1, {Target(tokens_server_), Ca()});
    return RunCli(args, env);
  }
  static std::string EnvToken(const char* token) { return absl::StrCat("ROPEATTN_TOKEN=", token); }

  static testing::TlsMaterial* material_;
  static server::Server* tokens_server_;
  static server::Server* mtls_server_;
};

testing::TlsMaterial* CliTlsTest::material_ = nullptr;
server::Server* CliTlsTest::tokens_server_ = nullptr;
server::Server* CliTlsTest::mtls_server_ = nullptr;

TEST_F(CliTlsTest, HealthAndInfoWithCaAndToken) {
  // Health needs no token (probes carry none), only TLS.
  RunResult r = TokensCli({"health"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, "SERVING\n");

  r = TokensCli({"info", absl::StrCat("--token=", testing::kAliceToken)});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, AllOf(HasSubstr("version"), HasSubstr("cpu")));
  EXPECT_EQ(r.err, "");

  // The token from the environment.
  r = TokensCli({"info", "--json"}, {EnvToken(testing::kAliceToken)});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("\"version\""));
  r = TokensCli({"health"}, {EnvToken(testing::kAliceToken)});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);

  // --token wins over the environment.
  r = TokensCli({"info", absl::StrCat("--token=", testing::kAliceToken)},
                {EnvToken(testing::kUnknownToken)});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
}

TEST_F(CliTlsTest, MissingOrUnknownTokenIsUnauthenticated) {
  RunResult r = TokensCli({"info"});
  EXPECT_EQ(r.exit_code, 16) << Describe(r);
  ExpectOneErrorLine(r, "info", "UNAUTHENTICATED");

  r = TokensCli({"info", absl::StrCat("--token=", testing::kUnknownToken)});
  EXPECT_EQ(r.exit_code, 16) << Describe(r);
  ExpectOneErrorLine(r, "info", "UNAUTHENTICATED");
  EXPECT_THAT(r.out + r.err, Not(HasSubstr(testing::kUnknownToken)));

  r = TokensCli({"sessions"}, {EnvToken(testing::kUnknownToken)});
  EXPECT_EQ(r.exit_code, 16) << Describe(r);
  EXPECT_THAT(r.out + r.err, Not(HasSubstr(testing::kUnknownToken)));

  // --token= sends none, whatever the environment holds.
  r = TokensCli({"info", "--token="}, {EnvToken(testing::kAliceToken)});
  EXPECT_EQ(r.exit_code, 16) << Describe(r);

  // Plaintext to a TLS server: the handshake fails.
  r = RunCli({"health", Target(tokens_server_), "--deadline_seconds=5"});
  EXPECT_EQ(r.exit_code, 14) << Describe(r);
  ExpectOneErrorLine(r, "health", "UNAVAILABLE");
}

TEST_F(CliTlsTest, AttendDecodeAndSessionsCarryTheToken) {
  const std::string dir = MakeTempDir();
  const std::string out = absl::StrCat(dir, "/out.npy");
  const std::vector<std::string> env = {EnvToken(testing::kAliceToken)};
  RunResult r = TokensCli(
      {"attend", "--heads=2", "--head_dim=8", "--q_len=4", "--causal", "--out", out}, env);
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  absl::StatusOr<v1::Tensor> tensor = client::ReadNpy(out);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_THAT(tensor->shape(), ElementsAre(1, 4, 2, 8));

  // A Decode stream: open, prefill, steps, close.
  r = TokensCli({"decode", "--steps=2", "--context=3", "--heads=2", "--head_dim=8"}, env);
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("step    2"));
  r = TokensCli({"decode", "--steps=2", "--context=3", "--heads=2", "--head_dim=8"});
  EXPECT_EQ(r.exit_code, 16) << Describe(r);

  r = TokensCli({"sessions"}, env);
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
}

TEST_F(CliTlsTest, MutualTlsWithAClientCertificate) {
  const testing::CertFiles& cert = material_->client;
  RunResult r =
      RunCli({"info", Target(mtls_server_), Ca(), absl::StrCat("--tls_cert_file=", cert.cert_file),
              absl::StrCat("--tls_key_file=", cert.key_file)});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("version"));

  r = RunCli({"health", Target(mtls_server_), Ca(), "--deadline_seconds=5"});
  EXPECT_EQ(r.exit_code, 14) << Describe(r);
  ExpectOneErrorLine(r, "health", "UNAVAILABLE");
}

}  // namespace
}  // namespace ropeattn
