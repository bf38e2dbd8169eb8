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

/// Process exit codes.
pub mod exit {
    /// Released (or would release in dry-run).
    pub const RELEASED: i32 = 0;
    /// Held: a required stage lacks evidence; the reason is in the report.
    pub const HELD: i32 = 1;
    /// Bad input: config or profile rejected.
    pub const BAD_INPUT: i32 = 2;
}
