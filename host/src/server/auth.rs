//! Credentials of a request: the bearer token, and comparisons of secrets
//! whose time does not depend on where they differ.

use hyper::HeaderMap;

/// The token of an `Authorization: Bearer TOKEN` header. The scheme is
/// matched case-insensitively (RFC 9110 §11.1: `bearer` and `BEARER` are
/// the same scheme), the token is trimmed.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(hyper::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Compares in time independent of where the strings differ (only their
/// lengths show).
pub fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(hyper::header::AUTHORIZATION, v.parse().expect("header"));
        h
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_the_token_trimmed() {
        for v in ["Bearer k1", "bearer k1", "BEARER  k1 ", " Bearer k1"] {
            assert_eq!(bearer_token(&headers(v)), Some("k1"), "{v:?}");
        }
        for v in ["Basic k1", "Bearerk1", "Bearer ", "k1"] {
            assert_eq!(bearer_token(&headers(v)), None, "{v:?}");
        }
    }

    #[test]
    fn same_compares_whole_strings() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "abcd"));
    }
}
