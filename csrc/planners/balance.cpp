// Min-max quotas on a fixed placement (see balance.h).  The transportation network
// source -> expert (its tokens) -> its instances' ranks -> sink (T - base) carries every
// token iff T is feasible.  Starting from the lower bound, each max-flow that falls short
// leaves a min cut whose capacity grows by (ranks on its source side) per token of T, so
// T jumps to the smallest value that cut allows; T only rises, the flow is kept, and the
// first T that carries everything is the optimum (every T skipped was below some cut).
#include "balance.h"

#include <algorithm>
#include <vector>

#include "flow_graph.h"

namespace ultracomm::planners {

int64_t balance_quotas(int64_t W, int64_t n, const int64_t* el, const int64_t* off, const int64_t* inst,
                       const int64_t* base, int64_t* quota) {
  constexpr int kSource = 0, kSink = 1;
  const int rank0 = 2, exp0 = 2 + static_cast<int>(W);
  FlowGraph g(exp0 + static_cast<int>(n));
  std::vector<int> sink_arc(static_cast<size_t>(W)), inst_arc(static_cast<size_t>(off[n]));
  for (int64_t r = 0; r < W; ++r) sink_arc[r] = g.add_arc(rank0 + static_cast<int>(r), kSink, 0);
  int64_t moved = 0, total = 0, T = 0;
  for (int64_t e = 0; e < n; ++e) {
    g.add_arc(kSource, exp0 + static_cast<int>(e), el[e]);
    moved += el[e];
    for (int64_t i = off[e]; i < off[e + 1]; ++i)  // the home first: ties keep tokens there
      inst_arc[i] = g.add_arc(exp0 + static_cast<int>(e), rank0 + static_cast<int>(inst[i]), kFlowInf);
  }
  for (int64_t r = 0; r < W; ++r) {
    total += base[r];
    T = std::max(T, base[r]);
  }
  total += moved;
  T = std::max(T, (total + W - 1) / W);
  int64_t flow = 0;
  std::vector<char> side;
  for (;;) {
    for (int64_t r = 0; r < W; ++r) g.set_cap(sink_arc[r], T - base[r]);
    flow += g.max_flow(kSource, kSink);
    if (flow == moved) break;
    g.reachable(kSource, side);
    int64_t open = 0;  // ranks on the source side: their sink arcs are in the cut
    for (int64_t r = 0; r < W; ++r) open += side[rank0 + r];
    T += (moved - flow + open - 1) / std::max<int64_t>(open, 1);
  }
  for (int64_t i = 0; i < off[n]; ++i) quota[i] = g.flow(inst_arc[i]);
  return T;
}

}  // namespace ultracomm::planners
