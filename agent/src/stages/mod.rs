//! Stage bodies: each turns one boundary's raw data into evidence or a failure with a
//! stable reason code, by calling the pure decisions in `taintgate-validators` /
//! `taintgate-prefetch` over data read through the boundaries in [`context::Context`].
//! By family: [`cluster`] (register, allocatable, fit), [`gpu`] (driver, smoke, peer-bw),
//! [`network`] (fabric, network), [`kubelet`] (device-plugin, runtime), [`dra`] (dra, and which publication path the
//! node uses), [`prefetch`] (models, images).

pub mod cluster;
pub mod context;
pub mod dra;
pub mod gpu;
pub mod kubelet;
pub mod network;
pub mod prefetch;

pub use crate::node::is_registered;
pub use context::{Context, Evidence, Progress, StageFailure};

use crate::stage::Stage;

/// Run one attempt of `stage`'s body.
pub async fn run_stage_body(ctx: &Context, stage: Stage, progress: &Progress) -> Result<Evidence, StageFailure> {
    match stage {
        Stage::Register => cluster::register(ctx, progress).await,
        Stage::Driver => gpu::driver(ctx, progress).await,
        Stage::Smoke => gpu::smoke(ctx).await,
        Stage::PeerBw => gpu::peer_bw(ctx).await,
        Stage::Fabric => network::fabric(ctx, progress).await,
        Stage::Network => network::network(ctx).await,
        Stage::Allocatable => cluster::allocatable(ctx, progress).await,
        Stage::DevicePlugin => kubelet::device_plugin(ctx).await,
        Stage::Dra => dra::dra(ctx, progress).await,
        Stage::Cdi => kubelet::cdi(ctx).await,
        Stage::Fit => cluster::fit(ctx).await,
        Stage::Models => prefetch::models(ctx).await,
        Stage::Images => prefetch::images(ctx).await,
    }
}
