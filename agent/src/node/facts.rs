//! What the driver stage needs to know about its Node ([`NodeFacts`]: the instance-type
//! label the expected GPU count comes from), read once when the agent starts, so the
//! driver stage does not wait on the API and has no graph edge to `register`.
//!
//! Before the Node exists (the systemd unit starts before the kubelet registers it) the
//! facts say no Node was read; `gpu.expect.gpu_count` or `gpu.expect.instance_type` then
//! give the count. Without either, the driver stage waits for the Node (watching, within
//! its deadline; `GpuCountUnconfigured` if none comes), and a held node's facts are read
//! again before each re-evaluation until a Node is found ([`refresh`]).

use super::NodeApi;
use k8s_openapi::api::core::v1::Node;
use taintgate_validators::gpu::decide::{INSTANCE_TYPE_LABEL, NodeFacts};

/// The facts of a Node read (pure).
pub fn of_node(node: &Node) -> NodeFacts {
    NodeFacts {
        node_read: true,
        instance_type: node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(INSTANCE_TYPE_LABEL))
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty()),
    }
}

/// The facts at start: from the Node already read at start (`read`), else one GET. No API,
/// no Node yet or a failed read: no Node read (the failure is logged, not retried: the
/// configuration may still give the count, and [`refresh`] tries again before a re-run).
pub async fn at_start(api: Option<&dyn NodeApi>, read: Option<&Node>) -> NodeFacts {
    if let Some(node) = read {
        return of_node(node);
    }
    let Some(api) = api else {
        return NodeFacts::default();
    };
    match api.get().await {
        Ok(node) => of_node(&node),
        Err(e) => {
            tracing::info!(error = %e, "no Node to read the instance type from (yet)");
            NodeFacts::default()
        }
    }
}

/// Facts for the next evaluation: kept once a Node was read (the instance type of a
/// machine does not change), read again while none was.
pub async fn refresh(api: Option<&dyn NodeApi>, facts: NodeFacts) -> NodeFacts {
    if facts.node_read {
        return facts;
    }
    at_start(api, None).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn node(labels: &[(&str, &str)]) -> Node {
        let mut n = Node::default();
        n.metadata.labels = Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        n
    }

    #[test]
    fn instance_type_from_the_label_only() {
        let f = of_node(&node(&[
            (INSTANCE_TYPE_LABEL, "p5.48xlarge"),
            ("nvidia.com/gpu.count", "7"),
        ]));
        assert_eq!(f.instance_type.as_deref(), Some("p5.48xlarge"));
        assert!(f.node_read);
        // GFD's count is never a source: a Node with only that label has no instance type.
        let f = of_node(&node(&[("nvidia.com/gpu.count", "8")]));
        assert_eq!(
            f,
            NodeFacts {
                node_read: true,
                instance_type: None
            }
        );
        let f = of_node(&node(&[(INSTANCE_TYPE_LABEL, " ")]));
        assert_eq!(f.instance_type, None);
    }

    #[tokio::test]
    async fn no_api_no_node_read() {
        assert_eq!(at_start(None, None).await, NodeFacts::default());
        let n = node(&[(INSTANCE_TYPE_LABEL, "a3-highgpu-1g")]);
        assert_eq!(
            at_start(None, Some(&n)).await.instance_type.as_deref(),
            Some("a3-highgpu-1g")
        );
        let kept = of_node(&n);
        assert_eq!(refresh(None, kept.clone()).await, kept);
    }
}
