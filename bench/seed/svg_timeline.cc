#include "seed/svg_timeline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

namespace ckptio::cli {
namespace {

constexpr double kWidth = 1200;
constexpr double kLabelWidth = 200;  // track names left of the plot
constexpr double kRightMargin = 24;
constexpr double kPlotWidth = kWidth - kLabelWidth - kRightMargin;
constexpr double kLaneHeight = 5;
constexpr double kMinRowHeight = 16;
constexpr double kRowGap = 4;
constexpr int kMaxLanes = 8;

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// A rectangle to draw, in pixels along the time axis.
struct Bar {
  double x0, x1;
  std::string color;
  std::string label;  // for the tooltip
};

// Spans of one track, placed into lanes (greedy: the first lane free at the
// span's start) and merged within a lane where they are under a pixel apart.
std::vector<std::vector<Bar>> LayOut(std::vector<TimelineSpan> spans, double px_per_s, double max_x,
                                     const std::string& track_color) {
  std::sort(spans.begin(), spans.end(), [](const TimelineSpan& a, const TimelineSpan& b) { return a.start < b.start; });
  std::vector<std::vector<Bar>> lanes;
  std::vector<double> lane_end;  // seconds
  for (const TimelineSpan& s : spans) {
    if (s.end < 0 || s.start * px_per_s > max_x) continue;
    size_t lane = 0;
    while (lane < lane_end.size() && lane_end[lane] > s.start + 1e-9) ++lane;
    if (lane == lane_end.size()) {
      if (lanes.size() < kMaxLanes) {
        lanes.emplace_back();
        lane_end.push_back(0);
      } else {
        lane = static_cast<size_t>(std::min_element(lane_end.begin(), lane_end.end()) - lane_end.begin());
      }
    }
    lane_end[lane] = std::max(lane_end[lane], s.end);
    Bar b{std::max(0.0, s.start * px_per_s), std::min(max_x, s.end * px_per_s),
          s.color.empty() ? track_color : s.color, s.name};
    std::vector<Bar>& bars = lanes[lane];
    if (!bars.empty() && bars.back().color == b.color && b.x0 - bars.back().x1 < 1.0) {
      bars.back().x1 = std::max(bars.back().x1, b.x1);
      bars.back().label.clear();  // a merged bar has no single name
    } else {
      bars.push_back(std::move(b));
    }
  }
  return lanes;
}

// A tick step of 1, 2 or 5 times a power of ten giving about 10 ticks.
double TickStep(double duration) {
  const double raw = std::max(duration, 1e-3) / 10;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * p >= raw) return m * p;
  }
  return 10 * p;
}

std::string TickLabel(double t, double step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, step < 1 ? "%.1f s" : "%.0f s", t);
  return buf;
}

void Axis(std::string* out, double y, double top, double duration, double px_per_s) {
  // Ticks from the shared scale, not this panel's length: a short panel
  // would otherwise crowd its labels into a few pixels.
  const double step = TickStep(kPlotWidth / px_per_s);
  *out += "<line x1=\"" + Num(kLabelWidth) + "\" y1=\"" + Num(y) + "\" x2=\"" + Num(kLabelWidth + kPlotWidth) +
          "\" y2=\"" + Num(y) + "\" stroke=\"#444\"/>\n";
  for (double t = 0; t <= duration + 1e-9; t += step) {
    const double x = kLabelWidth + t * px_per_s;
    if (x > kLabelWidth + kPlotWidth + 0.5) break;
    *out += "<line x1=\"" + Num(x) + "\" y1=\"" + Num(top) + "\" x2=\"" + Num(x) + "\" y2=\"" + Num(y) +
            "\" stroke=\"#e0e0e0\"/>\n";
    *out += "<line x1=\"" + Num(x) + "\" y1=\"" + Num(y) + "\" x2=\"" + Num(x) + "\" y2=\"" + Num(y + 4) +
            "\" stroke=\"#444\"/>\n";
    *out += "<text x=\"" + Num(x) + "\" y=\"" + Num(y + 15) + "\" text-anchor=\"middle\" class=\"tick\">" +
            TickLabel(t, step) + "</text>\n";
  }
}

// Draws one panel from y; returns the y below it.
double Panel(std::string* out, const TimelinePanel& p, double y, double px_per_s) {
  *out += "<text x=\"8\" y=\"" + Num(y + 14) + "\" class=\"panel\">" + XmlEscape(p.title) + "</text>\n";
  y += 24;
  const double top = y;
  std::map<std::string, std::vector<TimelineSpan>> by_track;
  for (const TimelineSpan& s : p.spans) by_track[s.track].push_back(s);
  std::string rows;
  for (const TimelineTrack& t : p.tracks) {
    auto lanes = LayOut(by_track[t.name], px_per_s, kPlotWidth, t.color);
    const double lane_h = lanes.size() <= 2 ? kMinRowHeight / std::max<size_t>(lanes.size(), 1) : kLaneHeight;
    const double h = std::max(kMinRowHeight, lane_h * static_cast<double>(lanes.size()));
    rows += "<text x=\"" + Num(kLabelWidth - 8) + "\" y=\"" + Num(y + h / 2 + 4) +
            "\" text-anchor=\"end\" class=\"track\">" + XmlEscape(t.name) + "</text>\n";
    rows += "<rect x=\"" + Num(kLabelWidth) + "\" y=\"" + Num(y) + "\" width=\"" + Num(kPlotWidth) + "\" height=\"" +
            Num(h) + "\" fill=\"#f7f7f7\"/>\n";
    for (size_t l = 0; l < lanes.size(); ++l) {
      for (const Bar& b : lanes[l]) {
        rows += "<rect x=\"" + Num(kLabelWidth + b.x0) + "\" y=\"" + Num(y + lane_h * static_cast<double>(l)) +
                "\" width=\"" + Num(std::max(1.0, b.x1 - b.x0)) + "\" height=\"" + Num(std::max(1.0, lane_h - 0.5)) +
                "\" fill=\"" + b.color + "\"";
        if (!b.label.empty() && b.x1 - b.x0 >= 3) {
          rows += "><title>" + XmlEscape(b.label) + "</title></rect>\n";
        } else {
          rows += "/>\n";
        }
      }
    }
    y += h + kRowGap;
  }
  // Gridlines first, so the bars are drawn over them.
  Axis(out, y + 2, top, p.duration, px_per_s);
  *out += rows;
  return y + 30;
}

void Legend(std::string* out, const std::vector<std::pair<std::string, std::string>>& legend, double* y) {
  double x = kLabelWidth;
  for (const auto& [label, color] : legend) {
    const double w = 32 + 6.8 * static_cast<double>(label.size());
    if (x + w > kWidth - kRightMargin) {
      x = kLabelWidth;
      *y += 20;
    }
    *out += "<rect x=\"" + Num(x) + "\" y=\"" + Num(*y - 10) + "\" width=\"14\" height=\"12\" fill=\"" + color + "\"/>\n";
    *out += "<text x=\"" + Num(x + 19) + "\" y=\"" + Num(*y) + "\" class=\"legend\">" + XmlEscape(label) + "</text>\n";
    x += w;
  }
  *y += 16;
}

}  // namespace

std::string XmlEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\n' || c == '\t') out += c;
    }
  }
  return out;
}

std::string RenderTimelineSvg(const TimelineChart& chart) {
  double duration = 0;
  for (const TimelinePanel& p : chart.panels) duration = std::max(duration, p.duration);
  const double px_per_s = kPlotWidth / std::max(duration, 1e-3);
  std::string body;
  double y = 28;
  body += "<text x=\"8\" y=\"" + Num(y) + "\" class=\"title\">" + XmlEscape(chart.title) + "</text>\n";
  for (const std::string& line : chart.subtitle) {
    y += 17;
    body += "<text x=\"8\" y=\"" + Num(y) + "\" class=\"sub\">" + XmlEscape(line) + "</text>\n";
  }
  y += 14;
  for (const TimelinePanel& p : chart.panels) y = Panel(&body, p, y, px_per_s);
  Legend(&body, chart.legend, &y);
  const double height = y + 8;
  std::string out = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Num(kWidth) + "\" height=\"" +
                    Num(height) + "\" viewBox=\"0 0 " + Num(kWidth) + " " + Num(height) + "\" font-family=\"sans-serif\">\n";
  out += "<style>.title{font-size:16px;font-weight:bold}.sub{font-size:12px;fill:#333}"
         ".panel{font-size:14px;font-weight:bold}.track{font-size:11px;fill:#222}"
         ".tick{font-size:10px;fill:#444}.legend{font-size:11px;fill:#222}</style>\n";
  out += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out += body;
  out += "</svg>\n";
  return out;
}

}  // namespace ckptio::cli
