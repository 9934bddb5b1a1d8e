// Where a step's time goes: named regions timed on the device without synchronizing it, summed by
// name.  Off by default (a disabled Region costs one branch).  `kcpp bench --step` turns it on
// around a training step and prints the sums against each region's floor.
//
//   profile::enable(true);
//   { profile::Region r("GEMM", flops, bytes); ... }   // queued work between the two events
//   for (const profile::Row& row : profile::collect()) ...  // waits for the device, then sums
//
// Only outermost regions are recorded: a region opened inside another (the GEMMs of a reference
// layer inside that layer's region) belongs to the outer one, so the rows add up to the time they
// cover and never count a span twice.  On CUDA a region is a pair of events on the current stream;
// on the CPU, the wall clock.  One host thread records at a time (the model's).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"

namespace kcpp::profile {

void enable(bool on);
bool enabled();

class Region {
 public:
  // flops / bytes: the work the region does (its floor is the larger of flops over the GEMM rate
  // and bytes over the copy bandwidth); 0 where unknown.
  // The name is `name` followed by " " and `detail` when detail is given (built only when recording).
  Region(std::string_view name, Device device, double flops = 0, double bytes = 0, std::string_view detail = {});
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

 private:
  bool counted_ = false;  // opened while profiling was on (counts in the nesting depth)
  int index_ = -1;        // the record this region writes, or -1 when nested (not recorded)
};

struct Row {
  std::string name;
  int64_t calls = 0;
  double ms = 0, flops = 0, bytes = 0;
};

// Waits for the device, sums the regions recorded since the last collect() by name (in order of
// first appearance) and forgets them.
std::vector<Row> collect();

}  // namespace kcpp::profile
