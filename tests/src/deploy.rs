//! Helpers for the deployment-artifact tests (`tests/tests/deploy_*.rs`): reading the
//! shipped YAML (`daemonset/`, `karpenter/`, `systemd/`) into typed structs, with a
//! round-trip check that catches fields the type does not know (a misspelt key would
//! otherwise be dropped silently), and an evaluator for a `ValidatingAdmissionPolicy`
//! that runs its CEL (match conditions, variables, validations) with the `cel` crate
//! against sample admission requests, the way the API server does.
//!
//! Only core CEL is available to the evaluator (no Kubernetes string/list/regex
//! extension libraries), so an expression that passes here uses nothing the API server
//! lacks.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Failures reading or checking a deployment artifact. Each names the file or expression.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A YAML document did not parse, or did not fit its type.
    #[error("{path}: {message}")]
    Yaml {
        /// The file (and document index).
        path: String,
        /// What was wrong.
        message: String,
    },
    /// A typed parse dropped or changed fields: the document has keys its type lacks.
    #[error("{path}: {kind} does not round-trip through its type (unknown or misspelt field?): {detail}")]
    RoundTrip {
        /// The file.
        path: String,
        /// `apiVersion/kind`.
        kind: String,
        /// The first difference.
        detail: String,
    },
    /// A document's kind is not one the deployment is expected to contain.
    #[error("{path}: unexpected kind {kind}")]
    UnknownKind {
        /// The file.
        path: String,
        /// `apiVersion/kind`.
        kind: String,
    },
    /// A CEL expression failed to compile.
    #[error("CEL expression {name:?} does not compile: {message}")]
    CelCompile {
        /// The expression's name (variable name or validation index).
        name: String,
        /// The parser's message.
        message: String,
    },
    /// A CEL expression failed to evaluate, or did not yield the type it must.
    #[error("CEL expression {name:?} failed: {message}")]
    CelEval {
        /// The expression's name.
        name: String,
        /// The interpreter's message.
        message: String,
    },
    /// The policy document lacks something the evaluator needs.
    #[error("admission policy: {0}")]
    Policy(String),
}

impl DeployError {
    /// Stable reason code.
    pub fn reason(&self) -> &'static str {
        match self {
            DeployError::Io { .. } => "ReadFailed",
            DeployError::Yaml { .. } => "InvalidYaml",
            DeployError::RoundTrip { .. } => "UnknownField",
            DeployError::UnknownKind { .. } => "UnknownKind",
            DeployError::CelCompile { .. } => "CelCompileFailed",
            DeployError::CelEval { .. } => "CelEvalFailed",
            DeployError::Policy(_) => "InvalidPolicy",
        }
    }
}

/// The repository root (the parent of the `tests` crate).
pub fn repo_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(Path::to_path_buf).unwrap_or(here)
}

/// Every `.yaml`/`.yml` file under `dir`, recursively, sorted.
pub fn yaml_files_under(dir: &Path) -> Result<Vec<PathBuf>, DeployError> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|source| DeployError::Io {
            path: d.display().to_string(),
            source,
        })?;
        for e in entries {
            let e = e.map_err(|source| DeployError::Io {
                path: d.display().to_string(),
                source,
            })?;
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml")) {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Read a file to a string, naming it on error.
pub fn read(path: &Path) -> Result<String, DeployError> {
    std::fs::read_to_string(path).map_err(|source| DeployError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// The documents of a (multi-document) YAML text, as JSON values; empty documents (a
/// leading `---`, comments only) are skipped, as kubectl skips them.
pub fn yaml_documents_str(name: &str, text: &str) -> Result<Vec<Value>, DeployError> {
    let mut docs = Vec::new();
    for (i, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let v = Value::deserialize(de).map_err(|e| DeployError::Yaml {
            path: format!("{name} (document {i})"),
            message: e.to_string(),
        })?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// The documents of a YAML file.
pub fn yaml_documents(path: &Path) -> Result<Vec<Value>, DeployError> {
    yaml_documents_str(&path.display().to_string(), &read(path)?)
}

/// `apiVersion/kind` of a document ("?" where missing).
pub fn kind_of(doc: &Value) -> String {
    format!(
        "{}/{}",
        doc.get("apiVersion").and_then(Value::as_str).unwrap_or("?"),
        doc.get("kind").and_then(Value::as_str).unwrap_or("?")
    )
}

/// The first place where `a` and `b` differ, as a JSON pointer with both values.
pub fn first_difference(a: &Value, b: &Value, at: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let path = format!("{at}/{k}");
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => first_difference(p, q, &path),
                    (Some(p), None) => Some(format!("{path}: {p} was dropped")),
                    (None, Some(q)) => Some(format!("{path}: {q} appeared")),
                    (None, None) => None,
                }
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(p, q, &format!("{at}/{i}"))),
        _ if a == b => None,
        _ => Some(format!("{at}: {a} became {b}")),
    }
}

/// Parse `doc` as `T` and require that serialising it back gives the same document: a
/// key `T` does not know (a typo such as `tolerations[].efect`) fails here.
pub fn typed<T: DeserializeOwned + Serialize>(path: &str, doc: &Value) -> Result<T, DeployError> {
    let kind = kind_of(doc);
    let t: T = serde_json::from_value(doc.clone()).map_err(|e| DeployError::Yaml {
        path: path.to_string(),
        message: format!("{kind}: {e}"),
    })?;
    let back = serde_json::to_value(&t).map_err(|e| DeployError::Yaml {
        path: path.to_string(),
        message: format!("{kind}: cannot re-encode: {e}"),
    })?;
    if let Some(detail) = first_difference(doc, &back, "") {
        return Err(DeployError::RoundTrip {
            path: path.to_string(),
            kind,
            detail,
        });
    }
    Ok(t)
}

/// Check one Kubernetes document against its type (k8s-openapi for core kinds, the local
/// structs below for Karpenter and kustomize), returning its `apiVersion/kind`.
pub fn check_document(path: &str, doc: &Value) -> Result<String, DeployError> {
    use k8s_openapi::api::admissionregistration::v1 as adm;
    use k8s_openapi::api::apps::v1 as apps;
    use k8s_openapi::api::core::v1 as core;
    use k8s_openapi::api::rbac::v1 as rbac;
    let kind = kind_of(doc);
    match kind.as_str() {
        "v1/Namespace" => typed::<core::Namespace>(path, doc).map(drop),
        "v1/ServiceAccount" => typed::<core::ServiceAccount>(path, doc).map(drop),
        "v1/ConfigMap" => typed::<core::ConfigMap>(path, doc).map(drop),
        "apps/v1/DaemonSet" => typed::<apps::DaemonSet>(path, doc).map(drop),
        "rbac.authorization.k8s.io/v1/ClusterRole" => typed::<rbac::ClusterRole>(path, doc).map(drop),
        "rbac.authorization.k8s.io/v1/ClusterRoleBinding" => typed::<rbac::ClusterRoleBinding>(path, doc).map(drop),
        "rbac.authorization.k8s.io/v1/Role" => typed::<rbac::Role>(path, doc).map(drop),
        "rbac.authorization.k8s.io/v1/RoleBinding" => typed::<rbac::RoleBinding>(path, doc).map(drop),
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" => {
            typed::<adm::ValidatingAdmissionPolicy>(path, doc).map(drop)
        }
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding" => {
            typed::<adm::ValidatingAdmissionPolicyBinding>(path, doc).map(drop)
        }
        "karpenter.sh/v1/NodePool" => typed::<NodePool>(path, doc).map(drop),
        "karpenter.k8s.aws/v1/EC2NodeClass" => typed::<Ec2NodeClass>(path, doc).map(drop),
        "kustomize.config.k8s.io/v1beta1/Kustomization" => typed::<Kustomization>(path, doc).map(drop),
        "kustomize.config.k8s.io/v1alpha1/Component" => typed::<Component>(path, doc).map(drop),
        _ => Err(DeployError::UnknownKind {
            path: path.to_string(),
            kind: kind.clone(),
        }),
    }?;
    Ok(kind)
}

/// Object metadata as the local structs use it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Meta {
    /// Name.
    pub name: String,
    /// Labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// Karpenter `NodePool` (karpenter.sh/v1), the fields this repository uses.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodePool {
    /// `karpenter.sh/v1`.
    pub api_version: String,
    /// `NodePool`.
    pub kind: String,
    /// Metadata.
    pub metadata: Meta,
    /// Spec.
    pub spec: NodePoolSpec,
}

/// `NodePool.spec`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodePoolSpec {
    /// The NodeClaim template.
    pub template: NodeClaimTemplate,
    /// Disruption settings.
    pub disruption: Disruption,
    /// Resource limits of the pool.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, String>,
    /// Priority among pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<i32>,
}

/// `spec.template`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodeClaimTemplate {
    /// Labels and annotations put on the nodes.
    #[serde(default)]
    pub metadata: TemplateMeta,
    /// NodeClaim spec.
    pub spec: NodeClaimSpec,
}

/// `spec.template.metadata`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TemplateMeta {
    /// Node labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// `spec.template.spec`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodeClaimSpec {
    /// The NodeClass.
    pub node_class_ref: NodeClassRef,
    /// Scheduling requirements.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requirements: Vec<Requirement>,
    /// Taints put on the node at creation and expected to be removed by an agent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub startup_taints: Vec<Taint>,
    /// Permanent taints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taints: Vec<Taint>,
    /// Node lifetime (Go duration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expire_after: Option<String>,
    /// Longest drain (Go duration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub termination_grace_period: Option<String>,
}

/// A NodeClass reference.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeClassRef {
    /// API group.
    pub group: String,
    /// Kind.
    pub kind: String,
    /// Name.
    pub name: String,
}

/// A node selector requirement.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Requirement {
    /// Label key.
    pub key: String,
    /// `In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt`.
    pub operator: String,
    /// Values.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// A taint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Taint {
    /// Key.
    pub key: String,
    /// Value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Effect.
    pub effect: String,
}

/// `spec.disruption`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Disruption {
    /// `WhenEmpty` or `WhenEmptyOrUnderutilized`.
    pub consolidation_policy: String,
    /// Quiet period before consolidation (Go duration or `Never`).
    pub consolidate_after: String,
    /// Disruption budgets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<Budget>,
}

/// A disruption budget.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// Count or percentage of nodes.
    pub nodes: String,
    /// Reasons it applies to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    /// Cron schedule when it is active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// How long it is active after each schedule hit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<String>,
}

/// Karpenter AWS `EC2NodeClass` (karpenter.k8s.aws/v1), the fields this repository uses.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Ec2NodeClass {
    /// `karpenter.k8s.aws/v1`.
    pub api_version: String,
    /// `EC2NodeClass`.
    pub kind: String,
    /// Metadata.
    pub metadata: Meta,
    /// Spec.
    pub spec: Ec2NodeClassSpec,
}

/// `EC2NodeClass.spec`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Ec2NodeClassSpec {
    /// AMI selection.
    pub ami_selector_terms: Vec<BTreeMap<String, Value>>,
    /// Node IAM role.
    pub role: String,
    /// Subnet selection.
    pub subnet_selector_terms: Vec<BTreeMap<String, Value>>,
    /// Security group selection.
    pub security_group_selector_terms: Vec<BTreeMap<String, Value>>,
    /// Volumes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_device_mappings: Vec<BlockDeviceMapping>,
    /// IMDS settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_options: Option<BTreeMap<String, Value>>,
    /// User-data merged with Karpenter's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
}

/// A block device mapping.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BlockDeviceMapping {
    /// Device name.
    pub device_name: String,
    /// EBS settings.
    pub ebs: Ebs,
}

/// EBS volume settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Ebs {
    /// Size (quantity).
    pub volume_size: String,
    /// Type.
    pub volume_type: String,
    /// IOPS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops: Option<i64>,
    /// Throughput MiB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput: Option<i64>,
    /// Encrypted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encrypted: Option<bool>,
    /// Deleted with the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_on_termination: Option<bool>,
}

/// A kustomize `Kustomization`, the fields this repository uses.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Kustomization {
    /// `kustomize.config.k8s.io/v1beta1`.
    pub api_version: String,
    /// `Kustomization`.
    pub kind: String,
    /// Resource files.
    pub resources: Vec<String>,
    /// Generated ConfigMaps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub config_map_generator: Vec<ConfigMapGenerator>,
    /// Image overrides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<BTreeMap<String, String>>,
}

/// A kustomize `Component` (`daemonset/components/*`), the fields this repository uses.
/// Patches and replacements are kept as kustomize's own YAML: rendering them with a real
/// kubectl is what checks them.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Component {
    /// `kustomize.config.k8s.io/v1alpha1`.
    pub api_version: String,
    /// `Component`.
    pub kind: String,
    /// The namespace its transformer sets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Patches (target and inline patch).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patches: Vec<Value>,
    /// Replacements (source and targets).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replacements: Vec<Value>,
}

/// A `configMapGenerator` entry.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigMapGenerator {
    /// ConfigMap name (kustomize appends a content hash).
    pub name: String,
    /// Namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Files whose contents become keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
}

// ---------------------------------------------------------------------------------------
// ValidatingAdmissionPolicy evaluation
// ---------------------------------------------------------------------------------------

/// A compiled CEL expression with the name used in messages.
struct Compiled {
    name: String,
    program: cel::Program,
}

fn compile(name: &str, expression: &str) -> Result<Compiled, DeployError> {
    cel::Program::compile(expression)
        .map(|program| Compiled {
            name: name.to_string(),
            program,
        })
        .map_err(|e| DeployError::CelCompile {
            name: name.to_string(),
            message: e.to_string(),
        })
}

/// One validation of the policy.
struct Validation {
    expr: Compiled,
    message: String,
}

/// One resource rule of `matchConstraints` (operations and `resource[/subresource]`).
#[derive(Debug, Clone)]
struct ResourceRule {
    api_groups: Vec<String>,
    api_versions: Vec<String>,
    operations: Vec<String>,
    resources: Vec<String>,
}

/// The outcome of admitting one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The policy does not apply (resource rules or match conditions did not match).
    NotMatched,
    /// Every validation held.
    Allowed,
    /// The messages of the validations that failed, in policy order.
    Denied(Vec<String>),
}

/// A `ValidatingAdmissionPolicy` compiled for evaluation.
pub struct AdmissionPolicy {
    failure_policy_fail: bool,
    rules: Vec<ResourceRule>,
    match_conditions: Vec<Compiled>,
    variables: Vec<Compiled>,
    validations: Vec<Validation>,
}

/// A sample admission request: what the API server hands the policy.
#[derive(Debug, Clone)]
pub struct AdmissionRequest {
    /// `request` (operation, resource, subResource, userInfo, ...).
    pub request: Value,
    /// The object after the change.
    pub object: Value,
    /// The object before the change.
    pub old_object: Value,
}

fn str_list(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect())
        .unwrap_or_default()
}

fn matches_one(list: &[String], value: &str) -> bool {
    list.iter().any(|x| x == "*" || x == value)
}

impl AdmissionPolicy {
    /// Compile the policy document (`admissionregistration.k8s.io/v1`,
    /// `ValidatingAdmissionPolicy`). Every expression must compile.
    pub fn from_document(doc: &Value) -> Result<Self, DeployError> {
        if kind_of(doc) != "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" {
            return Err(DeployError::Policy(format!(
                "expected a ValidatingAdmissionPolicy, found {}",
                kind_of(doc)
            )));
        }
        let spec = doc.get("spec").ok_or_else(|| DeployError::Policy("no spec".into()))?;
        if spec.get("paramKind").is_some() {
            return Err(DeployError::Policy(
                "paramKind is not supported by this evaluator".into(),
            ));
        }
        let failure_policy_fail = spec.get("failurePolicy").and_then(Value::as_str).unwrap_or("Fail") == "Fail";
        let rules = spec
            .pointer("/matchConstraints/resourceRules")
            .and_then(Value::as_array)
            .ok_or_else(|| DeployError::Policy("spec.matchConstraints.resourceRules missing".into()))?
            .iter()
            .map(|r| ResourceRule {
                api_groups: str_list(r.get("apiGroups")),
                api_versions: str_list(r.get("apiVersions")),
                operations: str_list(r.get("operations")),
                resources: str_list(r.get("resources")),
            })
            .collect();
        let named = |key: &str| -> Result<Vec<Compiled>, DeployError> {
            spec.get(key)
                .and_then(Value::as_array)
                .map(|a| a.as_slice())
                .unwrap_or_default()
                .iter()
                .map(|m| {
                    let name = m.get("name").and_then(Value::as_str).unwrap_or("?");
                    let expr = m
                        .get("expression")
                        .and_then(Value::as_str)
                        .ok_or_else(|| DeployError::Policy(format!("{key} {name} has no expression")))?;
                    compile(name, expr)
                })
                .collect()
        };
        let match_conditions = named("matchConditions")?;
        let variables = named("variables")?;
        let validations = spec
            .get("validations")
            .and_then(Value::as_array)
            .ok_or_else(|| DeployError::Policy("spec.validations missing".into()))?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let expr = v
                    .get("expression")
                    .and_then(Value::as_str)
                    .ok_or_else(|| DeployError::Policy(format!("validation {i} has no expression")))?;
                if v.get("messageExpression").is_some() {
                    return Err(DeployError::Policy(format!(
                        "validation {i}: messageExpression is not supported by this evaluator"
                    )));
                }
                let message = v
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("failed expression")
                    .to_string();
                Ok(Validation {
                    expr: compile(&format!("validations[{i}]"), expr)?,
                    message,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            failure_policy_fail,
            rules,
            match_conditions,
            variables,
            validations,
        })
    }

    /// The messages of every validation, in order.
    pub fn messages(&self) -> Vec<&str> {
        self.validations.iter().map(|v| v.message.as_str()).collect()
    }

    /// Evaluate the policy's variables for a request (they are what the tests compare
    /// with the shipped config).
    pub fn variables(&self, req: &AdmissionRequest) -> Result<BTreeMap<String, Value>, DeployError> {
        let mut vars = BTreeMap::new();
        for v in &self.variables {
            let value = self.eval(&v.name, &v.program, req, &vars)?;
            vars.insert(v.name.clone(), value);
        }
        Ok(vars)
    }

    fn eval(
        &self,
        name: &str,
        program: &cel::Program,
        req: &AdmissionRequest,
        vars: &BTreeMap<String, Value>,
    ) -> Result<Value, DeployError> {
        let err = |message: String| DeployError::CelEval {
            name: name.to_string(),
            message,
        };
        let mut ctx = cel::Context::default();
        let to_cel = |v: &Value| cel::to_value(v).map_err(|e| err(format!("cannot convert input: {e}")));
        ctx.add_variable_from_value("object", to_cel(&req.object)?);
        ctx.add_variable_from_value("oldObject", to_cel(&req.old_object)?);
        ctx.add_variable_from_value("request", to_cel(&req.request)?);
        ctx.add_variable_from_value("params", cel::Value::Null);
        ctx.add_variable_from_value("namespaceObject", cel::Value::Null);
        let vars_json = serde_json::to_value(vars).map_err(|e| err(e.to_string()))?;
        ctx.add_variable_from_value("variables", to_cel(&vars_json)?);
        let out = program.execute(&ctx).map_err(|e| err(e.to_string()))?;
        cel_to_json(&out).map_err(err)
    }

    fn eval_bool(
        &self,
        c: &Compiled,
        req: &AdmissionRequest,
        vars: &BTreeMap<String, Value>,
    ) -> Result<bool, DeployError> {
        match self.eval(&c.name, &c.program, req, vars)? {
            Value::Bool(b) => Ok(b),
            other => Err(DeployError::CelEval {
                name: c.name.clone(),
                message: format!("yielded {other}, not a bool"),
            }),
        }
    }

    /// Admit one request as the API server would: resource rules, then match conditions
    /// (any false: not matched), then variables, then every validation. An evaluation
    /// error denies under `failurePolicy: Fail` (and is returned as an error otherwise, so
    /// a test never mistakes a broken expression for a pass).
    pub fn admit(&self, req: &AdmissionRequest) -> Result<Decision, DeployError> {
        let r = &req.request;
        let get = |p: &str| r.pointer(p).and_then(Value::as_str).unwrap_or("");
        let resource = match get("/subResource") {
            "" => get("/resource/resource").to_string(),
            sub => format!("{}/{}", get("/resource/resource"), sub),
        };
        let rule_hit = self.rules.iter().any(|rule| {
            matches_one(&rule.api_groups, get("/resource/group"))
                && matches_one(&rule.api_versions, get("/resource/version"))
                && matches_one(&rule.operations, get("/operation"))
                && matches_one(&rule.resources, &resource)
        });
        if !rule_hit {
            return Ok(Decision::NotMatched);
        }
        let fail = |e: DeployError| -> Result<Decision, DeployError> {
            if self.failure_policy_fail {
                Ok(Decision::Denied(vec![format!("{e}")]))
            } else {
                Err(e)
            }
        };
        let empty = BTreeMap::new();
        for m in &self.match_conditions {
            match self.eval_bool(m, req, &empty) {
                Ok(true) => {}
                Ok(false) => return Ok(Decision::NotMatched),
                Err(e) => return fail(e),
            }
        }
        let vars = match self.variables(req) {
            Ok(v) => v,
            Err(e) => return fail(e),
        };
        let mut denied = Vec::new();
        for v in &self.validations {
            match self.eval_bool(&v.expr, req, &vars) {
                Ok(true) => {}
                Ok(false) => denied.push(v.message.clone()),
                Err(e) => return fail(e),
            }
        }
        Ok(if denied.is_empty() {
            Decision::Allowed
        } else {
            Decision::Denied(denied)
        })
    }
}

/// A CEL result as JSON (variables are handed to later expressions through JSON).
fn cel_to_json(v: &cel::Value) -> Result<Value, String> {
    Ok(match v {
        cel::Value::Null => Value::Null,
        cel::Value::Bool(b) => Value::Bool(*b),
        cel::Value::Int(i) => Value::from(*i),
        cel::Value::UInt(u) => Value::from(*u),
        cel::Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(Value::Number)
            .ok_or_else(|| format!("non-finite float {f}"))?,
        cel::Value::String(s) => Value::String(s.to_string()),
        cel::Value::List(items) => Value::Array(items.iter().map(cel_to_json).collect::<Result<_, _>>()?),
        cel::Value::Map(m) => {
            let mut out = serde_json::Map::new();
            for (k, val) in m.map.iter() {
                let key = match k {
                    cel::objects::Key::String(s) => s.to_string(),
                    other => return Err(format!("map key {other:?} is not a string")),
                };
                out.insert(key, cel_to_json(val)?);
            }
            Value::Object(out)
        }
        other => return Err(format!("unsupported CEL value {other:?}")),
    })
}

// ---------------------------------------------------------------------------------------
// Rendering the kustomize base with its components
// ---------------------------------------------------------------------------------------

/// How [`render_overlay`] installs the base into another namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamespaceBy {
    /// The shipped base as it is (`taintgate-system`).
    Base,
    /// `daemonset/components/namespace/` with its `namespace:` set (what
    /// `kustomize edit set namespace` writes there).
    Component,
    /// A plain `namespace:` in the overlay itself, which the component's comment warns
    /// against.
    OverlayField,
}

/// Render, with `kubectl kustomize`, an overlay of a copy of `daemonset/` that lists
/// `components` (names under `daemonset/components/`) and installs into `ns` as `by` says.
/// kustomize refuses absolute and out-of-tree paths, so base and overlay are copied side by
/// side into a temporary directory.
pub fn render_overlay(kubectl: &Path, ns: &str, by: NamespaceBy, components: &[&str]) -> anyhow::Result<Vec<Value>> {
    use anyhow::{Context, bail};
    let tmp = tempfile::tempdir()?;
    let base = tmp.path().join("daemonset");
    let out = std::process::Command::new("cp")
        .arg("-r")
        .arg(repo_root().join("daemonset"))
        .arg(&base)
        .output()
        .context("copying daemonset/")?;
    if !out.status.success() {
        bail!("cp -r daemonset/: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut comps: Vec<String> = components
        .iter()
        .map(|c| format!("../daemonset/components/{c}"))
        .collect();
    let mut field = String::new();
    match by {
        NamespaceBy::Base => {}
        NamespaceBy::Component => {
            let k = base.join("components/namespace/kustomization.yaml");
            let text = std::fs::read_to_string(&k)?;
            let edited = text.replacen("\nnamespace: taintgate-system\n", &format!("\nnamespace: {ns}\n"), 1);
            if edited == text {
                bail!("components/namespace/kustomization.yaml has no `namespace: taintgate-system` line");
            }
            std::fs::write(&k, edited)?;
            comps.push("../daemonset/components/namespace".into());
        }
        NamespaceBy::OverlayField => field = format!("namespace: {ns}\n"),
    }
    let overlay = tmp.path().join("overlay");
    std::fs::create_dir(&overlay)?;
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [../daemonset]\n{field}components: [{}]\n",
            comps.join(", ")
        ),
    )?;
    let out = std::process::Command::new(kubectl)
        .arg("kustomize")
        .arg(&overlay)
        .output()
        .with_context(|| format!("running {} kustomize", kubectl.display()))?;
    if !out.status.success() {
        bail!(
            "{} kustomize (namespace {ns}, {by:?}, components {components:?}): {}",
            kubectl.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(yaml_documents_str(
        "kustomize output",
        &String::from_utf8_lossy(&out.stdout),
    )?)
}
