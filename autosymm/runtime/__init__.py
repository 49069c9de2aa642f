"""The runtime's machinery, op-agnostic: a group's agreed state and its prepared calls (group),
the rank agreement (agreement, call_check), the dispatcher and its neighbour rule (dispatch,
neighbours), launch replay (replay) and the MoE region's room (moe_room). The collectives' front
doors (autosymm.collectives) build on it; it imports none of them (ARCHITECTURE.md)."""
