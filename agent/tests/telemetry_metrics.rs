//! The metrics endpoint over real loopback HTTP: `/healthz` always 200, `/readyz` 503
//! until the shared flag is set, `/metrics` in OpenMetrics text with the stage
//! histogram, failures by reason, prefetch bytes and release time of observed timelines.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use jiff::Timestamp;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use taintgate::reasons::Reason;
use taintgate::telemetry::metrics::{Metrics, serve};
use taintgate::timeline::{Outcome, StageRecord, Timeline, Verdict};
use taintgate_validators::reason::ReasonCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let (head, body) = buf.split_once("\r\n\r\n").unwrap();
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, head.to_lowercase(), body.to_string())
}

fn rec(stage: &str, start_ms: u64, dur: u64, outcome: Outcome, reason: Option<&str>) -> StageRecord {
    StageRecord {
        stage: taintgate::stage::RecordKind::from_name(stage).unwrap(),
        start: Timestamp::UNIX_EPOCH,
        start_ms,
        duration_ms: dur,
        outcome,
        required: true,
        attempts: 1,
        reason: reason.map(|r| r.parse().unwrap()),
        message: None,
        summary: String::new(),
        evidence: if stage == "models" {
            taintgate::evidence::Detail::Models(taintgate::evidence::ModelsDetail {
                bytes_fetched: 5_000_000,
                bytes_cached: 1_000,
                report: Default::default(),
            })
        } else {
            taintgate::evidence::Detail::None
        },
    }
}

fn timeline(released: bool) -> Timeline {
    let mut stages = vec![
        rec("driver", 0, 420, Outcome::Passed, None),
        rec(
            "models",
            0,
            12_000,
            if released { Outcome::Passed } else { Outcome::Failed },
            (!released).then_some("DigestMismatch"),
        ),
    ];
    if released {
        stages.push(rec("untaint", 12_010, 30, Outcome::Passed, None));
    }
    Timeline {
        node: "n".into(),
        agent_start: Timestamp::UNIX_EPOCH,
        gpu_backend: "simulated".into(),
        stages,
        verdict: Some(Verdict {
            released,
            dry_run: false,
            reason: if released {
                Reason::Released
            } else {
                Reason::DigestMismatch
            },
            message: String::new(),
            at_ms: 12_041,
            at: Timestamp::UNIX_EPOCH,
        }),
    }
}

#[tokio::test]
async fn endpoint_serves_health_readiness_and_metrics() {
    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let server = serve("127.0.0.1:0".parse().unwrap(), metrics.clone(), ready.clone())
        .await
        .unwrap();
    let addr = server.addr;
    assert_eq!(get(addr, "/healthz").await.0, 200);
    assert_eq!(get(addr, "/readyz").await.0, 503, "not ready before release");

    // A held pass, then a released one (the agent re-evaluates a held node).
    metrics.observe_timeline(&timeline(false));
    let (code, head, body) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    assert!(head.contains("content-type: application/openmetrics-text"), "{head}");
    assert!(body.contains("taintgate_released 0"), "{body}");
    metrics.observe_timeline(&timeline(true));
    ready.store(true, Ordering::Release);
    assert_eq!(get(addr, "/readyz").await.0, 200);
    let (_, _, body) = get(addr, "/metrics").await;
    for want in [
        "# TYPE taintgate_stage_duration_seconds histogram",
        r#"taintgate_stage_duration_seconds_count{stage="models",result="failed"} 1"#,
        r#"taintgate_stage_duration_seconds_count{stage="models",result="passed"} 1"#,
        r#"taintgate_stage_duration_seconds_bucket{le="0.8",stage="driver",result="passed"} 2"#,
        r#"taintgate_stage_duration_seconds_bucket{le="0.4",stage="driver",result="passed"} 0"#,
        r#"taintgate_failures_total{reason="DigestMismatch"} 1"#,
        r#"taintgate_prefetch_bytes_total{kind="fetched"} 10000000"#,
        r#"taintgate_prefetch_bytes_total{kind="cached"} 2000"#,
        r#"taintgate_release_duration_seconds_bucket{le="10.0"} 0"#,
        r#"taintgate_release_duration_seconds_bucket{le="15.0"} 1"#,
        "taintgate_release_duration_seconds_sum 12.04",
        "taintgate_released 1",
        "# EOF",
    ] {
        assert!(body.contains(want), "missing {want:?} in\n{body}");
    }
    assert_eq!(get(addr, "/nope").await.0, 404);

    // The port is taken now: a typed error naming the address.
    let e = serve(addr, metrics, ready).await.unwrap_err();
    assert_eq!(e.reason(), Reason::MetricsBindFailed);
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
    server.handle.abort();
}
