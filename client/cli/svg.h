// A tiny SVG writer and the two chart types `ropeattn plot` draws: line
// charts (linear or log y) and heatmaps with a color bar. Output is plain
// SVG 1.1; every text and attribute value is XML-escaped.
//
// Charts mark their parts with classes so tools (and tests) can read them
// back: ticks are <text class="xtick"|"ytick" data-value="V" x=".." y="..">,
// series are <polyline class="series" data-series="NAME" points="x,y ...">,
// the plot area is <rect class="plot-area" data-x0.. data-x1.. (pixel box)>.
#ifndef ROPEATTN_CLIENT_CLI_SVG_H_
#define ROPEATTN_CLIENT_CLI_SVG_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace ropeattn::cli::svg {

// Escapes &, <, >, " and ' for text content and attribute values; drops
// control characters XML 1.0 does not allow.
std::string Escape(absl::string_view text);
// A number for a coordinate or attribute: fixed, at most 3 decimals.
std::string Num(double value);

class Document {
 public:
  Document(double width, double height);

  // `extra` is appended verbatim inside the element: build it with Attr().
  void Rect(double x, double y, double w, double h, absl::string_view fill,
            absl::string_view extra = "");
  void Line(double x1, double y1, double x2, double y2, absl::string_view stroke, double width,
            absl::string_view extra = "");
  void Polyline(absl::Span<const std::pair<double, double>> points, absl::string_view stroke,
                double width, absl::string_view extra = "");
  void Circle(double cx, double cy, double r, absl::string_view fill, absl::string_view extra = "");
  // anchor: "start", "middle" or "end"; rotate in degrees about (x, y).
  void Text(double x, double y, absl::string_view text, absl::string_view anchor = "start",
            double size = 12, double rotate = 0, absl::string_view extra = "");
  void BeginGroup(absl::string_view extra);
  void EndGroup();

  // The whole document (with the XML declaration and closing tag).
  std::string Finish() const;

 private:
  double width_, height_;
  std::string body_;
};

// ' name="escaped value"'.
std::string Attr(absl::string_view name, absl::string_view value);

// Maps data values to pixels, linearly or logarithmically (base 10).
struct Scale {
  double lo = 0, hi = 1;        // data range (positive for log)
  double px_lo = 0, px_hi = 1;  // pixel positions of lo and hi
  bool log = false;
  double Map(double value) const;
};

// "Nice" tick values (1, 2, 5 x 10^k steps) covering [lo, hi], about
// `target` of them; and the widened range they span.
std::vector<double> NiceTicks(double lo, double hi, int target);
// Powers of ten within [lo, hi] (for a log axis).
std::vector<double> LogTicks(double lo, double hi);
// A tick label: %g with the digits the value needs ("0.5", "100", "1e+06").
std::string TickLabel(double value);

struct Series {
  std::string name;
  std::vector<double> x, y;
  bool markers = false;  // dots at the points as well as the line
};

struct ChartOptions {
  std::string title, subtitle, x_label, y_label;
  bool log_y = false;
  double width = 820, height = 520;
  // Start the y axis at zero (linear axes) even when the data does not.
  bool y_from_zero = false;
};

// A line chart with title, ticked and labelled axes, grid, and a legend
// when there is more than one series (in the corner the curves cross least).
std::string LineChart(const ChartOptions& options, absl::Span<const Series> series);

struct HeatmapOptions {
  std::string title, subtitle, x_label, y_label, value_label;
  double width = 820, height = 620;
  // Color range; diverging (blue-white-red, for signed data) or sequential.
  double vmin = 0, vmax = 1;
  bool diverging = false;
};

// rows x cols values (row-major); row 0 at the top. Cells are drawn as
// rects; a color bar with ticks shows the scale.
std::string Heatmap(const HeatmapOptions& options, int64_t rows, int64_t cols,
                    absl::Span<const float> values);

// Writes `content` to `path` (the errno's status, naming the path, on failure).
absl::Status WriteFile(const std::string& path, absl::string_view content);

}  // namespace ropeattn::cli::svg

#endif  // ROPEATTN_CLIENT_CLI_SVG_H_
