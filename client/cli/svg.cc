#include "client/cli/svg.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace ropeattn::cli::svg {
namespace {

constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
constexpr const char* kFont = "font-family=\"Helvetica, Arial, sans-serif\"";

struct Rgb {
  double r, g, b;
};

// Piecewise-linear colormaps (viridis; RdBu reversed so negative is blue).
constexpr Rgb kViridis[] = {
    {68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
constexpr Rgb kDiverging[] = {
    {33, 102, 172}, {103, 169, 207}, {247, 247, 247}, {239, 138, 98}, {178, 24, 43}};

std::string Color(double t, bool diverging) {
  const Rgb* map = diverging ? kDiverging : kViridis;
  if (!std::isfinite(t)) return "#000000";
  t = std::clamp(t, 0.0, 1.0) * 4;
  const int i = std::min(3, static_cast<int>(t));
  const double f = t - i;
  auto mix = [&](double a, double b) { return static_cast<int>(std::lround(a + (b - a) * f)); };
  return absl::StrFormat("#%02x%02x%02x", mix(map[i].r, map[i + 1].r), mix(map[i].g, map[i + 1].g),
                         mix(map[i].b, map[i + 1].b));
}

void DrawTitle(Document& doc, double width, absl::string_view title, absl::string_view subtitle) {
  doc.Text(width / 2, subtitle.empty() ? 30 : 22, title, "middle", 17, 0,
           " class=\"title\" font-weight=\"bold\"");
  if (!subtitle.empty()) {
    doc.Text(width / 2, 40, subtitle, "middle", 11, 0, " class=\"subtitle\" fill=\"#555555\"");
  }
}

}  // namespace

std::string Escape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') break;
        out += c;
    }
  }
  return out;
}

std::string Num(double value) {
  if (!std::isfinite(value)) return "0";
  std::string s = absl::StrFormat("%.3f", value);
  absl::string_view view = s;
  if (view.find('.') != absl::string_view::npos) {
    while (absl::ConsumeSuffix(&view, "0")) {
    }
    absl::ConsumeSuffix(&view, ".");
  }
  if (view == "-0") return "0";
  return std::string(view);
}

std::string Attr(absl::string_view name, absl::string_view value) {
  return absl::StrCat(" ", name, "=\"", Escape(value), "\"");
}

Document::Document(double width, double height) : width_(width), height_(height) {}

void Document::Rect(double x, double y, double w, double h, absl::string_view fill,
                    absl::string_view extra) {
  absl::StrAppend(&body_, "<rect x=\"", Num(x), "\" y=\"", Num(y), "\" width=\"", Num(w),
                  "\" height=\"", Num(h), "\"", Attr("fill", fill), extra, "/>\n");
}

void Document::Line(double x1, double y1, double x2, double y2, absl::string_view stroke,
                    double width, absl::string_view extra) {
  absl::StrAppend(&body_, "<line x1=\"", Num(x1), "\" y1=\"", Num(y1), "\" x2=\"", Num(x2),
                  "\" y2=\"", Num(y2), "\"", Attr("stroke", stroke), " stroke-width=\"", Num(width),
                  "\"", extra, "/>\n");
}

void Document::Polyline(absl::Span<const std::pair<double, double>> points,
                        absl::string_view stroke, double width, absl::string_view extra) {
  std::string coords;
  coords.reserve(points.size() * 16);
  for (const auto& [x, y] : points) {
    if (!coords.empty()) coords += ' ';
    absl::StrAppend(&coords, Num(x), ",", Num(y));
  }
  absl::StrAppend(&body_, "<polyline points=\"", coords, "\" fill=\"none\"", Attr("stroke", stroke),
                  " stroke-width=\"", Num(width), "\" stroke-linejoin=\"round\"", extra, "/>\n");
}

void Document::Circle(double cx, double cy, double r, absl::string_view fill,
                      absl::string_view extra) {
  absl::StrAppend(&body_, "<circle cx=\"", Num(cx), "\" cy=\"", Num(cy), "\" r=\"", Num(r), "\"",
                  Attr("fill", fill), extra, "/>\n");
}

void Document::Text(double x, double y, absl::string_view text, absl::string_view anchor,
                    double size, double rotate, absl::string_view extra) {
  absl::StrAppend(&body_, "<text x=\"", Num(x), "\" y=\"", Num(y), "\"",
                  Attr("text-anchor", anchor), " font-size=\"", Num(size), "\"");
  if (rotate != 0) {
    absl::StrAppend(&body_, " transform=\"rotate(", Num(rotate), " ", Num(x), " ", Num(y), ")\"");
  }
  absl::StrAppend(&body_, extra, ">", Escape(text), "</text>\n");
}

void Document::BeginGroup(absl::string_view extra) { absl::StrAppend(&body_, "<g", extra, ">\n"); }
void Document::EndGroup() { body_ += "</g>\n"; }

std::string Document::Finish() const {
  return absl::StrCat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"",
      Num(width_), "\" height=\"", Num(height_), "\" viewBox=\"0 0 ", Num(width_), " ",
      Num(height_), "\" ", kFont, ">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      body_, "</svg>\n");
}

double Scale::Map(double value) const {
  double a = lo, b = hi, v = value;
  if (log) {
    a = std::log10(lo);
    b = std::log10(hi);
    v = std::log10(value);
  }
  if (b == a) return (px_lo + px_hi) / 2;
  return px_lo + (v - a) / (b - a) * (px_hi - px_lo);
}

std::vector<double> NiceTicks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {0, 1};
  if (hi < lo) std::swap(lo, hi);
  if (hi - lo < 1e-12 * std::max(1.0, std::abs(hi))) {
    lo -= 0.5 * std::max(1.0, std::abs(lo));
    hi += 0.5 * std::max(1.0, std::abs(hi));
  }
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
  const double first = std::floor(lo / step + 1e-9);
  const double last = std::ceil(hi / step - 1e-9);
  std::vector<double> ticks;
  for (double i = first; i <= last; ++i) {
    double t = i * step;
    if (std::abs(t) < step * 1e-9) t = 0;
    ticks.push_back(t);
  }
  return ticks;
}

std::vector<double> LogTicks(double lo, double hi) {
  std::vector<double> ticks;
  for (int e = static_cast<int>(std::floor(std::log10(lo) + 1e-9));
       e <= static_cast<int>(std::ceil(std::log10(hi) - 1e-9)); ++e) {
    ticks.push_back(std::pow(10.0, e));
  }
  return ticks;
}

std::string TickLabel(double value) {
  if (value == 0) return "0";
  // Nice ticks have few significant digits; %g keeps them plain ("100",
  // "0.25") and switches to exponents only for very large or small values.
  for (int digits = 6; digits <= 15; ++digits) {
    std::string s = absl::StrFormat("%.*g", digits, value);
    double back = 0;
    if (std::sscanf(s.c_str(), "%lf", &back) == 1 &&
        std::abs(back - value) <= 1e-9 * std::abs(value)) {
      return s;
    }
  }
  return absl::StrFormat("%.17g", value);
}

std::string LineChart(const ChartOptions& options, absl::Span<const Series> series) {
  const double left = 90, right = 30, top = 50, bottom = 65;
  const double x0 = left, x1 = options.width - right, y0 = top, y1 = options.height - bottom;
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin;
  double ymin = xmin, ymax = -xmin;
  for (const Series& s : series) {
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      if (options.log_y && s.y[i] <= 0) continue;
      xmin = std::min(xmin, s.x[i]);
      xmax = std::max(xmax, s.x[i]);
      ymin = std::min(ymin, s.y[i]);
      ymax = std::max(ymax, s.y[i]);
    }
  }
  if (!std::isfinite(xmin)) xmin = 0, xmax = 1, ymin = options.log_y ? 1 : 0, ymax = 10;
  if (options.y_from_zero && !options.log_y) ymin = std::min(ymin, 0.0);

  // x spans exactly the data (distances, indices); y is widened to ticks.
  if (xmax <= xmin) xmax = xmin + 1;
  std::vector<double> xticks;
  for (double t : NiceTicks(xmin, xmax, 8)) {
    if (t >= xmin - 1e-9 * (xmax - xmin) && t <= xmax + 1e-9 * (xmax - xmin)) xticks.push_back(t);
  }
  std::vector<double> yticks = options.log_y ? LogTicks(ymin, ymax) : NiceTicks(ymin, ymax, 6);
  if (options.log_y && yticks.size() < 2) yticks.push_back(yticks.back() * 10);
  Scale xs{xmin, xmax, x0, x1, false};
  Scale ys{yticks.front(), yticks.back(), y1, y0, options.log_y};

  Document doc(options.width, options.height);
  DrawTitle(doc, options.width, options.title, options.subtitle);
  doc.Rect(
      x0, y0, x1 - x0, y1 - y0, "none",
      absl::StrCat(" class=\"plot-area\" stroke=\"#333333\"", Attr("data-x0", Num(x0)),
                   Attr("data-x1", Num(x1)), Attr("data-y0", Num(y0)), Attr("data-y1", Num(y1))));
  for (double t : xticks) {
    const double px = xs.Map(t);
    doc.Line(px, y0, px, y1, "#e6e6e6", 1);
    doc.Line(px, y1, px, y1 + 6, "#333333", 1,
             absl::StrCat(" class=\"xtick\"", Attr("data-value", TickLabel(t))));
    doc.Text(px, y1 + 21, TickLabel(t), "middle", 12, 0, " class=\"xtick-label\"");
  }
  for (double t : yticks) {
    const double py = ys.Map(t);
    doc.Line(x0, py, x1, py, "#e6e6e6", 1);
    doc.Line(x0 - 6, py, x0, py, "#333333", 1,
             absl::StrCat(" class=\"ytick\"", Attr("data-value", TickLabel(t))));
    doc.Text(x0 - 9, py + 4, TickLabel(t), "end", 12, 0, " class=\"ytick-label\"");
  }
  doc.Text((x0 + x1) / 2, options.height - 18, options.x_label, "middle", 14, 0,
           " class=\"xlabel\"");
  doc.Text(22, (y0 + y1) / 2, options.y_label, "middle", 14, -90, " class=\"ylabel\"");

  std::vector<std::vector<std::pair<double, double>>> all_points;
  for (size_t k = 0; k < series.size(); ++k) {
    const Series& s = series[k];
    const char* color = kPalette[k % std::size(kPalette)];
    std::vector<std::pair<double, double>> points;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      if (options.log_y && s.y[i] <= 0) continue;
      points.emplace_back(xs.Map(s.x[i]), ys.Map(s.y[i]));
    }
    doc.Polyline(points, color, 1.8,
                 absl::StrCat(" class=\"series\"", Attr("data-series", s.name)));
    if (s.markers) {
      doc.BeginGroup(absl::StrCat(" class=\"markers\"", Attr("data-series", s.name)));
      for (const auto& [px, py] : points) doc.Circle(px, py, 2.5, color);
      doc.EndGroup();
    }
    all_points.push_back(std::move(points));
  }

  if (series.size() > 1) {
    size_t longest = 0;
    for (const Series& s : series) longest = std::max(longest, s.name.size());
    const double w = 40 + 7.5 * longest, h = 10 + 20 * series.size();
    // The corner the curves cross least: top right, top left, bottom right,
    // bottom left.
    double lx = x1 - w - 10, ly = y0 + 10;
    size_t fewest = std::numeric_limits<size_t>::max();
    for (const auto& [cx, cy] :
         {std::pair{x1 - w - 10, y0 + 10}, std::pair{x0 + 10, y0 + 10},
          std::pair{x1 - w - 10, y1 - h - 10}, std::pair{x0 + 10, y1 - h - 10}}) {
      size_t inside = 0;
      for (const auto& points : all_points) {
        for (const auto& [px, py] : points) {
          inside += px >= cx && px <= cx + w && py >= cy && py <= cy + h;
        }
      }
      if (inside < fewest) {
        fewest = inside;
        lx = cx;
        ly = cy;
      }
    }
    doc.BeginGroup(" class=\"legend\"");
    doc.Rect(lx, ly, w, h, "white", " stroke=\"#999999\" fill-opacity=\"0.9\"");
    for (size_t k = 0; k < series.size(); ++k) {
      const double cy = ly + 15 + 20 * k;
      doc.Line(lx + 8, cy, lx + 30, cy, kPalette[k % std::size(kPalette)], 2.5);
      doc.Text(lx + 36, cy + 4, series[k].name, "start", 12, 0, " class=\"legend-label\"");
    }
    doc.EndGroup();
  }
  return doc.Finish();
}

std::string Heatmap(const HeatmapOptions& options, int64_t rows, int64_t cols,
                    absl::Span<const float> values) {
  const double left = 80, right = 120, top = 50, bottom = 65;
  const double x0 = left, x1 = options.width - right, y0 = top, y1 = options.height - bottom;
  const double cw = (x1 - x0) / std::max<int64_t>(cols, 1);
  const double ch = (y1 - y0) / std::max<int64_t>(rows, 1);
  const double range = options.vmax > options.vmin ? options.vmax - options.vmin : 1;

  Document doc(options.width, options.height);
  DrawTitle(doc, options.width, options.title, options.subtitle);
  doc.BeginGroup(" class=\"cells\" shape-rendering=\"crispEdges\"");
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      const double v = i < values.size() ? values[i] : 0;
      // Slightly oversized cells avoid hairline gaps between neighbours.
      doc.Rect(x0 + c * cw, y0 + r * ch, cw + 0.05, ch + 0.05,
               Color((v - options.vmin) / range, options.diverging));
    }
  }
  doc.EndGroup();
  doc.Rect(
      x0, y0, x1 - x0, y1 - y0, "none",
      absl::StrCat(" class=\"plot-area\" stroke=\"#333333\"", Attr("data-x0", Num(x0)),
                   Attr("data-x1", Num(x1)), Attr("data-y0", Num(y0)), Attr("data-y1", Num(y1))));

  // Index ticks at cell centres.
  for (double t : NiceTicks(0, std::max<int64_t>(cols - 1, 1), 8)) {
    if (t < 0 || t > cols - 1 || t != std::floor(t)) continue;
    const double px = x0 + (t + 0.5) * cw;
    doc.Line(px, y1, px, y1 + 6, "#333333", 1,
             absl::StrCat(" class=\"xtick\"", Attr("data-value", TickLabel(t))));
    doc.Text(px, y1 + 21, TickLabel(t), "middle", 12, 0, " class=\"xtick-label\"");
  }
  for (double t : NiceTicks(0, std::max<int64_t>(rows - 1, 1), 8)) {
    if (t < 0 || t > rows - 1 || t != std::floor(t)) continue;
    const double py = y0 + (t + 0.5) * ch;
    doc.Line(x0 - 6, py, x0, py, "#333333", 1,
             absl::StrCat(" class=\"ytick\"", Attr("data-value", TickLabel(t))));
    doc.Text(x0 - 9, py + 4, TickLabel(t), "end", 12, 0, " class=\"ytick-label\"");
  }
  doc.Text((x0 + x1) / 2, options.height - 18, options.x_label, "middle", 14, 0,
           " class=\"xlabel\"");
  doc.Text(22, (y0 + y1) / 2, options.y_label, "middle", 14, -90, " class=\"ylabel\"");

  // Color bar: vmax at the top.
  const double bx = x1 + 25, bw = 18;
  constexpr int kSteps = 64;
  doc.BeginGroup(" class=\"colorbar\" shape-rendering=\"crispEdges\"");
  for (int i = 0; i < kSteps; ++i) {
    const double t = (i + 0.5) / kSteps;
    const double h = (y1 - y0) / kSteps;
    doc.Rect(bx, y1 - (i + 1) * h, bw, h + 0.05, Color(t, options.diverging));
  }
  doc.Rect(bx, y0, bw, y1 - y0, "none", " stroke=\"#333333\"");
  Scale bar{options.vmin, options.vmin + range, y1, y0, false};
  for (double t : NiceTicks(options.vmin, options.vmin + range, 5)) {
    if (t < options.vmin - 1e-9 * range || t > options.vmin + range + 1e-9 * range) continue;
    const double py = bar.Map(t);
    doc.Line(bx + bw, py, bx + bw + 5, py, "#333333", 1,
             absl::StrCat(" class=\"ctick\"", Attr("data-value", TickLabel(t))));
    doc.Text(bx + bw + 8, py + 4, TickLabel(t), "start", 11, 0, " class=\"ctick-label\"");
  }
  doc.Text(bx + bw + 62, (y0 + y1) / 2, options.value_label, "middle", 13, -90,
           " class=\"clabel\"");
  doc.EndGroup();
  return doc.Finish();
}

absl::Status WriteFile(const std::string& path, absl::string_view content) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path, " for writing"));
  }
  const size_t written = std::fwrite(content.data(), 1, content.size(), file);
  const int write_errno = errno;
  if (std::fclose(file) != 0 || written != content.size()) {
    return absl::ErrnoToStatus(write_errno, absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

}  // namespace ropeattn::cli::svg
