//! Running the agent: its lifecycle from the parsed command line to the exit code
//! ([`lifecycle`]: build, the start rule, bootstraps until one releases the node, resident
//! mode), the executor ([`graph`]), one bootstrap from the stage graph to the verdict and
//! the untaint ([`bootstrap`]), the verdict's pure decisions ([`verdict`]), resident mode
//! after release ([`resident`]), and a start on a node already released ([`start`]).

pub mod bootstrap;
pub mod graph;
pub mod lifecycle;
pub mod resident;
pub mod start;
pub mod verdict;

/// Process exit codes (the reason catalogue's, where each reason's class names one).
pub use crate::reasons::exit;
