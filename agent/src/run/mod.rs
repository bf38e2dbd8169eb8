//! Running the stages: the executor ([`graph`]), one bootstrap from the stage graph to the
//! verdict, the untaint and the report ([`bootstrap`]), and resident mode after release
//! ([`resident`]), and a start on a node already released ([`start`]).

pub mod bootstrap;
pub mod graph;
pub mod resident;
pub mod start;
