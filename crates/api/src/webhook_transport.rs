//! Webhook deliveries over HTTP(S), to public addresses only unless the operator allows
//! more.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use sandbar_core::webhooks::{WebhookPostError, WebhookTransport};

/// How long a receiver has to answer one attempt.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Posts deliveries with reqwest. The URL's host is resolved for each attempt and the
/// connection pinned to the address that was checked, so a name that resolves elsewhere a
/// moment later (DNS rebinding) cannot lead a delivery to the host or a private network.
/// Redirects are not followed: a receiver cannot send the server on to another address.
#[derive(Debug, Clone)]
pub struct HttpWebhookTransport {
    /// Deliveries may go to loopback and private addresses (tests, a receiver on the same
    /// network); off by default.
    allow_private: bool,
}

impl HttpWebhookTransport {
    pub fn new(allow_private: bool) -> Self {
        Self { allow_private }
    }
}

/// Whether `ip` is an address of the public internet: not this host, not a private,
/// shared, link-local, multicast or otherwise special range.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || first == 0x2001 && v6.segments()[1] == 0x0db8)
        }
    }
}

#[async_trait::async_trait]
impl WebhookTransport for HttpWebhookTransport {
    async fn post(
        &self,
        url: &str,
        headers: &[(&'static str, String)],
        body: Vec<u8>,
    ) -> Result<u16, WebhookPostError> {
        let parsed =
            url::Url::parse(url).map_err(|e| WebhookPostError::Refused(format!("{url}: {e}")))?;
        let (Some(host), Some(port)) = (parsed.host_str(), parsed.port_or_known_default()) else {
            return Err(WebhookPostError::Refused(format!("{url}: no host")));
        };
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let addresses: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|e| WebhookPostError::Unreachable(format!("cannot resolve {host}: {e}")))?
            .collect();
        // Every address the name has must be allowed: which one a connection would take is
        // not the server's to choose.
        if !self.allow_private
            && let Some(refused) = addresses.iter().find(|a| !is_public(a.ip()))
        {
            return Err(WebhookPostError::Refused(format!(
                "{host} resolves to {}, which is not a public address",
                refused.ip()
            )));
        }
        let Some(address) = addresses.first().copied() else {
            return Err(WebhookPostError::Unreachable(format!(
                "{host} has no address"
            )));
        };
        // reqwest is built without a bundled crypto provider; ring, installed once for the
        // process (a second install fails harmlessly), serves https receivers.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(ATTEMPT_TIMEOUT)
            .resolve(&host, address)
            .build()
            .map_err(|e| WebhookPostError::Unreachable(e.to_string()))?;
        let mut request = client.post(parsed).body(body);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let response = request
            .send()
            .await
            .map_err(|e| WebhookPostError::Unreachable(e.to_string()))?;
        Ok(response.status().as_u16())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
        ] {
            assert!(!is_public(private.parse().expect("address")), "{private}");
        }
        for public in ["1.1.1.1", "8.8.4.4", "2606:4700::1111"] {
            assert!(is_public(public.parse().expect("address")), "{public}");
        }
    }
}
