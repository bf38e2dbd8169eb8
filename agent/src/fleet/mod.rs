//! `taintgate timeline`: reads timeline annotations back from Nodes, prints one node's
//! stamp chain or a fleet's per-interval percentiles, and draws them as SVG.
