//! Object stores named by URL (`s3://bucket/prefix`, `gs://…`, `az://…`,
//! `file:///path`), as the flags that take one (`--state-store`,
//! `--usage-log`) accept them: one builder path for the three clouds and
//! the local file system.

use anyhow::{anyhow, bail, Context, Result};
use object_store::path::Path;
use object_store::{ClientConfigKey, ObjectStore, RetryConfig};
use std::sync::Arc;
use std::time::Duration;

/// A store opened from a URL, and where under it to write.
pub struct ObjectUrl {
    pub store: Arc<dyn ObjectStore>,
    /// The path the URL names inside its bucket or container (empty for
    /// `file://`, whose root is the path itself).
    pub prefix: Path,
    /// `file://` only: the directory the store lives in.
    pub local_root: Option<std::path::PathBuf>,
}

/// Opens the store `url` names, for the flag `flag` (named in every
/// error). Cloud credentials and endpoints come from the environment as
/// each SDK names them (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`,
/// `AWS_ALLOW_HTTP`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_ACCOUNT_NAME`,
/// ...). A `file://` directory is created (0700) if missing.
pub fn open(flag: &str, url: &str) -> Result<ObjectUrl> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| {
        anyhow!("{flag} {url}: give a URL such as s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or file:///path")
    })?;
    // Fail fast unless the environment says otherwise: callers retry on
    // their own schedule, and nothing that serves a request waits on these.
    let timeouts = [
        (ClientConfigKey::Timeout, "5s"),
        (ClientConfigKey::ConnectTimeout, "2s"),
    ];
    let retry = RetryConfig {
        max_retries: 2,
        retry_timeout: Duration::from_secs(5),
        ..RetryConfig::default()
    };
    let bucket_prefix = |rest: &str| -> (String, String) {
        let (b, p) = rest.split_once('/').unwrap_or((rest, ""));
        (b.to_string(), p.trim_matches('/').to_string())
    };
    // One cloud: its builder from the environment, our timeouts where the
    // environment sets none, the bucket (or container) and retries.
    macro_rules! cloud {
        ($builder:path, $key:path, $with_bucket:ident) => {{
            use object_store::*;
            let (bucket, prefix) = bucket_prefix(rest);
            let mut b = <$builder>::from_env();
            for (k, v) in timeouts {
                let k = <$key>::Client(k);
                if b.get_config_value(&k).is_none() {
                    b = b.with_config(k, v);
                }
            }
            let s = b
                .$with_bucket(bucket)
                .with_retry(retry)
                .build()
                .with_context(|| format!("{flag} {url}"))?;
            ObjectUrl {
                store: Arc::new(s),
                prefix: Path::from(prefix),
                local_root: None,
            }
        }};
    }
    Ok(match scheme {
        "s3" | "s3a" => cloud!(
            aws::AmazonS3Builder,
            aws::AmazonS3ConfigKey,
            with_bucket_name
        ),
        "gs" => cloud!(
            gcp::GoogleCloudStorageBuilder,
            gcp::GoogleConfigKey,
            with_bucket_name
        ),
        "az" | "azure" => cloud!(
            azure::MicrosoftAzureBuilder,
            azure::AzureConfigKey,
            with_container_name
        ),
        "file" => {
            let root = std::path::PathBuf::from(rest);
            if !root.is_absolute() {
                bail!("{flag} {url}: a file store needs an absolute path (file:///path)");
            }
            {
                use std::os::unix::fs::DirBuilderExt;
                // 0700, as every directory of server state.
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&root)
                    .with_context(|| format!("cannot create {flag} {}", root.display()))?;
            }
            let s = object_store::local::LocalFileSystem::new_with_prefix(&root)
                .with_context(|| format!("{flag} {url}"))?;
            ObjectUrl {
                store: Arc::new(s),
                prefix: Path::default(),
                local_root: Some(root),
            }
        }
        other => {
            bail!("{flag} {url}: the scheme '{other}' is not one of s3, gs, az and file")
        }
    })
}
