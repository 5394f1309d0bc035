//! The dashboard's static files: its own script and style sheet, and the npm libraries
//! `build.rs` embedded, each kept gzipped too.

use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::error::PageError;

/// (name, bytes, gzipped bytes), from `build.rs`.
static VENDOR: &[(&str, &[u8], &[u8])] = include!(concat!(env!("OUT_DIR"), "/vendor_assets.rs"));

const APP_JS: &[u8] = include_bytes!("../assets/app.js");
const APP_CSS: &[u8] = include_bytes!("../assets/app.css");

struct Asset {
    name: &'static str,
    plain: &'static [u8],
    gzipped: Vec<u8>,
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    // Writing into memory cannot fail.
    let _ = encoder.write_all(bytes);
    encoder.finish().unwrap_or_default()
}

static ASSETS: LazyLock<Vec<Asset>> = LazyLock::new(|| {
    let mut assets: Vec<Asset> = VENDOR
        .iter()
        .map(|(name, plain, gz)| Asset {
            name,
            plain,
            gzipped: gz.to_vec(),
        })
        .collect();
    for (name, plain) in [("app.js", APP_JS), ("app.css", APP_CSS)] {
        assets.push(Asset {
            name,
            plain,
            gzipped: gzip(plain),
        });
    }
    assets
});

fn content_type(name: &str) -> &'static str {
    if name.ends_with(".js") {
        "text/javascript; charset=utf-8"
    } else if name.ends_with(".css") {
        "text/css; charset=utf-8"
    } else {
        "application/octet-stream"
    }
}

/// `GET /assets/{name}`: gzipped when the browser takes it.
pub(crate) async fn serve(Path(name): Path<String>, headers: HeaderMap) -> Response {
    let Some(asset) = ASSETS.iter().find(|a| a.name == name) else {
        return PageError::new(StatusCode::NOT_FOUND, format!("no asset '{name}'")).into_response();
    };
    let gzip_ok = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|e| e.trim().starts_with("gzip")));
    let body = if gzip_ok {
        &asset.gzipped[..]
    } else {
        asset.plain
    };
    let mut response = body.to_vec().into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(content_type(asset.name)),
    );
    // Assets change only with the binary; an hour spares reloads without pinning old ones.
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=3600"),
    );
    h.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    if gzip_ok {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    response
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn every_library_is_embedded_with_its_gzip() {
        for name in [
            "htmx.min.js",
            "xterm.js",
            "xterm.css",
            "addon-attach.js",
            "addon-fit.js",
            "app.js",
            "app.css",
        ] {
            let asset = ASSETS.iter().find(|a| a.name == name).unwrap();
            assert!(!asset.plain.is_empty());
            assert!(asset.gzipped.len() < asset.plain.len(), "{name}");
        }
    }
}
