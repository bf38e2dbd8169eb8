//! Running the stages: the executor ([`graph`]), one bootstrap from the stage graph to the
//! verdict, the untaint and the report ([`bootstrap`]), and resident mode after release
//! ([`resident`]).

pub mod bootstrap;
pub mod graph;
pub mod resident;
