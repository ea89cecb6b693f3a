// Exact integer token split over expert instances, per replica slot (see split.cpp).
#pragma once
#include <cstdint>

namespace ultracomm::planners {

// load [W, E]; inst_rank, quota, inst_slot [E, I] (inst_slot: flat slot r*K+k of each
// replica instance, unused for instance 0); rep [W, WK] out.
void split_slots(int64_t W, int64_t E, int64_t I, int64_t WK, const int64_t* load, const int64_t* inst_rank,
                 const int64_t* quota, const int64_t* inst_slot, int64_t* rep);

}  // namespace ultracomm::planners
