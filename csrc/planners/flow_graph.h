// Small residual flow graph for the planners: int64 capacities, Dinic max-flow that
// continues from the current flow, widest (max-bottleneck) residual paths, and rollback
// to a mark (arcs are only appended, so a search can undo what it added).
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace ultracomm::planners {

inline constexpr int64_t kFlowInf = int64_t{1} << 60;

class FlowGraph {
 public:
  explicit FlowGraph(int nodes = 0) { reset(nodes); }
  void reset(int nodes);  // drop every arc; `nodes` isolated nodes
  int nodes() const { return static_cast<int>(adj_.size()); }
  // Arc u -> v; returns its id (the reverse arc is id ^ 1).
  int add_arc(int u, int v, int64_t cap);
  int64_t flow(int arc) const { return arcs_[arc].flow; }
  int64_t residual(int arc) const { return arcs_[arc].cap - arcs_[arc].flow; }
  int head(int arc) const { return arcs_[arc].to; }
  int tail(int arc) const { return arcs_[arc ^ 1].to; }
  const std::vector<int>& out(int u) const { return adj_[u]; }  // arcs leaving u (both kinds)
  void set_cap(int arc, int64_t cap) { arcs_[arc].cap = cap; }
  void add_flow(int arc, int64_t d) {  // the caller keeps it within the capacity
    arcs_[arc].flow += d;
    arcs_[arc ^ 1].flow -= d;
  }
  void clear_flow();
  // Augments the current flow to a maximum s -> t; returns the increase.
  int64_t max_flow(int s, int t);
  // side[v] = 1 for the nodes a residual path from s reaches (the source side of a min cut
  // once the flow is maximal).
  void reachable(int s, std::vector<char>& side);
  // best[v]: the largest bottleneck of a residual path s -> v (0: unreachable; best[s] = inf).
  void widest_from(int s, std::vector<int64_t>& best);
  // best[v]: the largest bottleneck of a residual path v -> t (0: none; best[t] = inf).
  void widest_to(int t, std::vector<int64_t>& best);

  struct Mark {
    std::size_t num_arcs = 0;
    std::vector<int64_t> flow;
  };
  void mark(Mark& m) const;
  void rollback(const Mark& m);  // arcs added after the mark go, flows return to the mark's

 private:
  struct Arc {
    int to;
    int64_t cap;
    int64_t flow;
  };
  bool levels(int s, int t);
  int64_t push(int u, int t, int64_t limit);
  void widest(int root, bool forward, std::vector<int64_t>& best);
  std::vector<Arc> arcs_;
  std::vector<std::vector<int>> adj_;
  std::vector<int> level_, next_, queue_;
  std::vector<std::pair<int64_t, int>> heap_;
};

}  // namespace ultracomm::planners
