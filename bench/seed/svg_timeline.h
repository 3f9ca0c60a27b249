#pragma once
// A timeline as a self-contained SVG: one or more panels sharing one time
// scale (so a shorter run looks shorter), one row per track, a rectangle per
// span, an axis in seconds under each panel and a legend at the bottom.
//
// Spans of a track that overlap (parallel writes, overlapping saves) are
// stacked in lanes inside the row; spans closer than a pixel are drawn as
// one rectangle, so tens of thousands of tiny spans (io_uring batches) keep
// the file small. Pure: no I/O; any thread.

#include <string>
#include <utility>
#include <vector>

namespace ckptio::cli {

// [start, end) in seconds on a named track.
struct TimelineSpan {
  std::string track;
  std::string name;
  double start = 0;
  double end = 0;
  std::string color;  // empty: the track's color
};

struct TimelineTrack {
  std::string name;
  std::string color;  // any SVG color, e.g. "#1e88e5"
};

struct TimelinePanel {
  std::string title;
  double duration = 0;  // seconds shown: [0, duration]
  std::vector<TimelineTrack> tracks;  // rows, top to bottom
  std::vector<TimelineSpan> spans;    // on tracks by name; others are ignored
};

struct TimelineChart {
  std::string title;
  std::vector<std::string> subtitle;  // lines under the title
  std::vector<TimelinePanel> panels;
  std::vector<std::pair<std::string, std::string>> legend;  // label, color
};

std::string RenderTimelineSvg(const TimelineChart& chart);

// Escapes &, <, >, " and ' for XML text and attributes.
std::string XmlEscape(const std::string& s);

}  // namespace ckptio::cli
