//! Kubernetes name rules the config validates against (qualified names for taint keys,
//! condition types and labels; DNS subdomains). A leaf: the config sections use it.

/// Kubernetes qualified name: optional DNS-subdomain prefix + `/` + name of at most 63
/// characters, alphanumeric at both ends, `-_.` inside.
pub fn valid_qualified_name(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if let Some(p) = prefix
        && !valid_dns_subdomain(p)
    {
        return false;
    }
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
}

/// RFC 1123 DNS subdomain.
pub fn valid_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}
