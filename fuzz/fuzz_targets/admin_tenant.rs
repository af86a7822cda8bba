//! The body of `PUT /admin/v1/tenants/{id}` and the checks the admin API
//! runs on it (tenant names, scheduling ranges, plugin policies).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagoda::tenants::{valid_name, TenantSpec};

fuzz_target!(|data: &[u8]| {
    if let Ok(id) = std::str::from_utf8(data) {
        let _ = valid_name(id);
    }
    let Ok(spec) = serde_json::from_slice::<TenantSpec>(data) else {
        return;
    };
    let _ = spec.scheduling.check();
    let _ = pagoda::tenants::check_chain_items(spec.plugins.unwrap_or_default());
});
