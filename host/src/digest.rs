//! Content digests shared by the tenant store and the plugin runtime, kept
//! apart from both so neither has to reach into the other for them.

use sha2::{Digest, Sha256};

/// The sha256 of `b` as 64 lowercase hex digits: how uploaded components
/// and their precompiled artifacts are named and checked.
pub fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}
