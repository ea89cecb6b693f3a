// Residual flow graph (see flow_graph.h).
#include "flow_graph.h"

#include <algorithm>

namespace ultracomm::planners {

void FlowGraph::reset(int nodes) {
  arcs_.clear();
  adj_.assign(static_cast<size_t>(nodes), {});
}

int FlowGraph::add_arc(int u, int v, int64_t cap) {
  const int id = static_cast<int>(arcs_.size());
  arcs_.push_back({v, cap, 0});
  arcs_.push_back({u, 0, 0});
  adj_[u].push_back(id);
  adj_[v].push_back(id + 1);
  return id;
}

void FlowGraph::clear_flow() {
  for (Arc& a : arcs_) a.flow = 0;
}

bool FlowGraph::levels(int s, int t) {
  level_.assign(adj_.size(), -1);
  queue_.clear();
  level_[s] = 0;
  queue_.push_back(s);
  for (size_t qi = 0; qi < queue_.size(); ++qi) {
    const int u = queue_[qi];
    for (int a : adj_[u]) {
      const Arc& x = arcs_[a];
      if (x.cap - x.flow > 0 && level_[x.to] < 0) {
        level_[x.to] = level_[u] + 1;
        queue_.push_back(x.to);
      }
    }
  }
  return level_[t] >= 0;
}

int64_t FlowGraph::push(int u, int t, int64_t limit) {
  if (u == t) return limit;
  for (int& i = next_[u]; i < static_cast<int>(adj_[u].size()); ++i) {
    const int a = adj_[u][i];
    Arc& x = arcs_[a];
    if (x.cap - x.flow <= 0 || level_[x.to] != level_[u] + 1) continue;
    const int64_t d = push(x.to, t, std::min(limit, x.cap - x.flow));
    if (d > 0) {
      x.flow += d;
      arcs_[a ^ 1].flow -= d;
      return d;
    }
  }
  return 0;
}

int64_t FlowGraph::max_flow(int s, int t) {
  int64_t total = 0;
  while (levels(s, t)) {
    next_.assign(adj_.size(), 0);
    while (int64_t d = push(s, t, kFlowInf)) total += d;
  }
  return total;
}

void FlowGraph::reachable(int s, std::vector<char>& side) {
  levels(s, s);
  side.assign(adj_.size(), 0);
  for (size_t v = 0; v < adj_.size(); ++v) side[v] = level_[v] >= 0;
}

void FlowGraph::widest(int root, bool forward, std::vector<int64_t>& best) {
  // Dijkstra on bottlenecks; ties pop the lower node id first (deterministic).
  best.assign(adj_.size(), 0);
  best[root] = kFlowInf;
  heap_.clear();
  heap_.push_back({kFlowInf, -root});
  while (!heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end());
    const auto [b, neg_u] = heap_.back();
    heap_.pop_back();
    const int u = -neg_u;
    if (b < best[u]) continue;
    for (int a : adj_[u]) {
      // forward: arc a = u -> v; backward: the arc v -> u is a ^ 1 (v = head of a)
      const int v = arcs_[a].to;
      const Arc& x = forward ? arcs_[a] : arcs_[a ^ 1];
      const int64_t w = std::min(b, x.cap - x.flow);
      if (w > best[v]) {
        best[v] = w;
        heap_.push_back({w, -v});
        std::push_heap(heap_.begin(), heap_.end());
      }
    }
  }
}

void FlowGraph::widest_from(int s, std::vector<int64_t>& best) { widest(s, true, best); }
void FlowGraph::widest_to(int t, std::vector<int64_t>& best) { widest(t, false, best); }

void FlowGraph::mark(Mark& m) const {
  m.num_arcs = arcs_.size();
  m.flow.resize(arcs_.size());
  for (size_t i = 0; i < arcs_.size(); ++i) m.flow[i] = arcs_[i].flow;
}

void FlowGraph::rollback(const Mark& m) {
  while (arcs_.size() > m.num_arcs) {  // newest first: each is the last arc of its lists
    const int id = static_cast<int>(arcs_.size()) - 2;
    adj_[arcs_[id + 1].to].pop_back();
    adj_[arcs_[id].to].pop_back();
    arcs_.resize(arcs_.size() - 2);
  }
  for (size_t i = 0; i < arcs_.size(); ++i) arcs_[i].flow = m.flow[i];
}

}  // namespace ultracomm::planners
