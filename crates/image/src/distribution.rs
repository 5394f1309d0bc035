//! The requests of the registry API a pull makes (manifests, blobs, token authentication),
//! over HTTP clients whose every connection obeys the [`RegistryPolicy`].
//!
//! oci-client builds its reqwest client itself from a `ClientConfig` that offers no resolver,
//! no redirect policy and no way to hand it a client (proxies are its only connection
//! setting), so through it a registry's name, token realm or redirect could lead anywhere.
//! It still parses image references; the few requests a pull needs are made here instead:
//!
//! - a URL whose host is an address is checked before it is requested (such URLs never reach
//!   a resolver);
//! - names are resolved by the client's own resolver, which hands the connector only the
//!   addresses the rule allows, at connect time, so a name that answers differently after an
//!   earlier check gains nothing;
//! - redirects are followed here hop by hop (blob downloads often go to another host), each
//!   hop checked like the first request;
//! - a registry reached over https never leads to plain http: not by a redirect, a token
//!   service or an upload location, which would carry credentials and content in the clear;
//! - remote bodies never reach an error message: statuses are described, and the registry's
//!   error codes are only compared with the ones that mean "not found" or "not authorized".

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use reqwest::header::{
    ACCEPT, AUTHORIZATION, HeaderMap, HeaderName, HeaderValue, LOCATION, WWW_AUTHENTICATE,
};
use reqwest::{Method, Response, StatusCode};
use serde::Deserialize;
use url::Url;

use crate::pull_error::PullError;
use crate::registry_address::{Destination, RegistryPolicy, RegistryRefused, ResolveError};

const MAX_REDIRECTS: usize = 10;
/// Manifests and indexes are a few kilobytes; the caps keep a hostile registry from filling
/// memory.
const MAX_MANIFEST_BYTES: usize = 4 << 20;
const MAX_TOKEN_BYTES: usize = 1 << 20;
const MAX_ERROR_BODY_BYTES: usize = 64 << 10;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
const READ_TIMEOUT: Duration = Duration::from_secs(120);
const USER_AGENT: &str = concat!("sandbar/", env!("CARGO_PKG_VERSION"));

/// Credentials for one registry.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryAuth")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// Error codes of the distribution spec that mean the image is not there.
const NOT_FOUND_CODES: [&str; 5] = [
    "MANIFEST_UNKNOWN",
    "NAME_UNKNOWN",
    "BLOB_UNKNOWN",
    "MANIFEST_BLOB_UNKNOWN",
    "NOT_FOUND",
];
const UNAUTHORIZED_CODES: [&str; 2] = ["UNAUTHORIZED", "DENIED"];

/// One pull's conversation with one repository of one registry.
#[derive(Debug)]
pub(crate) struct Session {
    policy: Arc<RegistryPolicy>,
    /// `<scheme>://<registry>/v2/<repository>/`
    base: Url,
    repository: String,
    /// The image's normalised reference, for errors.
    name: String,
    credentials: Option<RegistryAuth>,
    /// What a token is asked for: `pull`, or `pull,push,delete` for a session that uploads
    /// and lets go of what it uploaded.
    actions: &'static str,
    /// What the registry's challenge led to, sent with every request to the registry.
    authorization: Mutex<Option<HeaderValue>>,
    /// One client per port: a resolver only learns the name, and the rule needs the port too.
    clients: Mutex<HashMap<u16, reqwest::Client>>,
}

impl Session {
    /// `registry`: `<scheme>://<host>[:port]/` of the registry.
    pub(crate) fn new(
        policy: Arc<RegistryPolicy>,
        registry: &Url,
        repository: &str,
        name: &str,
        credentials: Option<&RegistryAuth>,
    ) -> Result<Self, PullError> {
        let base =
            registry
                .join(&format!("v2/{repository}/"))
                .map_err(|e| PullError::BadReference {
                    reference: name.to_owned(),
                    reason: format!("repository `{repository}` does not fit in a URL: {e}"),
                })?;
        Ok(Self {
            policy,
            base,
            repository: repository.to_owned(),
            name: name.to_owned(),
            credentials: credentials.cloned(),
            actions: "pull",
            authorization: Mutex::new(None),
            clients: Mutex::new(HashMap::new()),
        })
    }

    /// The same session asking tokens that also allow uploads and deletes.
    pub(crate) fn pushing(mut self) -> Self {
        self.actions = "pull,push,delete";
        self
    }

    /// A request that is not a pull's GET (HEAD, POST, PATCH, PUT), authenticated as the
    /// registry's challenge asks; redirects are not followed. `body` is sent again when a
    /// challenge made the first attempt fail.
    pub(crate) async fn call(
        &self,
        method: Method,
        url: Url,
        headers: &[(HeaderName, HeaderValue)],
        body: Option<Bytes>,
    ) -> Result<Response, PullError> {
        let destination = Destination::of(&url).ok_or_else(|| {
            self.registry_error(format!("a {} URL is not a registry's", url.scheme()))
        })?;
        self.refuse_downgrade(self.base.scheme() == "https", &url, &destination)?;
        if let Some(address) = destination.literal {
            self.policy
                .check(&destination.host, destination.port, address)?;
        }
        let client = self.client(destination.port)?;
        self.authorized(|authorization| {
            let mut request = client.request(method.clone(), url.clone());
            for (name, value) in headers {
                request = request.header(name, value);
            }
            if let Some(body) = &body {
                request = request.body(body.clone());
            }
            if let Some(value) = authorization {
                request = request.header(AUTHORIZATION, value);
            }
            async move { request.send().await.map_err(|e| self.request_error(&e)) }
        })
        .await
    }

    /// The manifest (or index) `reference` (a tag or a digest) names, as the registry sent it.
    pub(crate) async fn manifest(
        &self,
        reference: &str,
        accept: &[&str],
    ) -> Result<Vec<u8>, PullError> {
        let url = self.url(&format!("manifests/{reference}"))?;
        let response = self.get(url, Some(&accept.join(", "))).await?;
        if response.status() != StatusCode::OK {
            return Err(self.status_error(response).await);
        }
        match read_limited(response, MAX_MANIFEST_BYTES).await {
            Ok(Some(body)) => Ok(body),
            Ok(None) => Err(self.registry_error(format!(
                "the manifest is larger than {MAX_MANIFEST_BYTES} bytes"
            ))),
            Err(e) => Err(self.stream_error(&e)),
        }
    }

    /// The response carrying blob `digest`; its body is the caller's to read (and check).
    pub(crate) async fn blob(&self, digest: &str) -> Result<Response, PullError> {
        let url = self.url(&format!("blobs/{digest}"))?;
        let response = self.get(url, None).await?;
        if response.status() != StatusCode::OK {
            return Err(self.status_error(response).await);
        }
        Ok(response)
    }

    /// An error while a body streams in.
    pub(crate) fn stream_error(&self, err: &reqwest::Error) -> PullError {
        PullError::Unreachable {
            reference: self.name.clone(),
            reason: format!("download interrupted: {}", error_chain(err)),
        }
    }

    /// `path` relative to the repository's API root (`blobs/uploads/`), or a `Location` the
    /// registry sent (absolute or relative to the registry).
    pub(crate) fn url(&self, path: &str) -> Result<Url, PullError> {
        self.base.join(path).map_err(|e| PullError::BadReference {
            reference: self.name.clone(),
            reason: format!("`{path}` does not fit in a URL: {e}"),
        })
    }

    /// A GET to the registry, authenticated as its challenge asks (once per request).
    async fn get(&self, url: Url, accept: Option<&str>) -> Result<Response, PullError> {
        self.authorized(|authorization| {
            let url = url.clone();
            async move { self.send(url, accept, authorization.as_ref()).await }
        })
        .await
    }

    /// Sends what `send` makes with the authorization the session holds; when the registry
    /// answers 401, once more with the one its challenge leads to, which later requests reuse.
    async fn authorized<F, Fut>(&self, send: F) -> Result<Response, PullError>
    where
        F: Fn(Option<HeaderValue>) -> Fut,
        Fut: std::future::Future<Output = Result<Response, PullError>>,
    {
        let mut challenged = false;
        loop {
            let authorization = self
                .authorization
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            let response = send(authorization).await?;
            if response.status() != StatusCode::UNAUTHORIZED || challenged {
                return Ok(response);
            }
            challenged = true;
            let challenges = challenges(response.headers());
            drop(response);
            let value = self.authenticate(&challenges).await?;
            *self
                .authorization
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(value);
        }
    }

    /// The `Authorization` value the first challenge this client understands leads to.
    async fn authenticate(&self, challenges: &[Challenge]) -> Result<HeaderValue, PullError> {
        let unauthorized = || PullError::Unauthorized {
            reference: self.name.clone(),
        };
        match challenges.first().ok_or_else(unauthorized)? {
            Challenge::Basic => self
                .credentials
                .as_ref()
                .map(|c| self.basic(c))
                .ok_or_else(unauthorized)?,
            Challenge::Bearer { realm, service } => {
                let token = self.token(realm, service.as_deref()).await?;
                let mut value =
                    HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                        self.registry_error("the token service sent an unusable token".to_owned())
                    })?;
                value.set_sensitive(true);
                Ok(value)
            }
        }
    }

    /// A pull token from the registry's token service (`realm`), with the credentials if any.
    async fn token(&self, realm: &str, service: Option<&str>) -> Result<String, PullError> {
        let mut url = Url::parse(realm).map_err(|_| {
            self.registry_error("the registry named a token service that is not a URL".to_owned())
        })?;
        url.query_pairs_mut().append_pair(
            "scope",
            &format!("repository:{}:{}", self.repository, self.actions),
        );
        if let Some(service) = service {
            url.query_pairs_mut().append_pair("service", service);
        }
        let credentials = match self.credentials.as_ref().map(|c| self.basic(c)) {
            Some(value) => Some(value?),
            None => None,
        };
        let response = self.send(url, None, credentials.as_ref()).await?;
        match response.status() {
            StatusCode::OK => {}
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return Err(PullError::Unauthorized {
                    reference: self.name.clone(),
                });
            }
            status => {
                return Err(self.registry_error(format!(
                    "the token service answered {}",
                    describe_status(status)
                )));
            }
        }
        #[derive(Deserialize)]
        struct TokenBody {
            token: Option<String>,
            access_token: Option<String>,
        }
        let body = match read_limited(response, MAX_TOKEN_BYTES).await {
            Ok(Some(body)) => body,
            Ok(None) => {
                return Err(self.registry_error("the token service's answer is too large".into()));
            }
            Err(e) => return Err(self.stream_error(&e)),
        };
        serde_json::from_slice::<TokenBody>(&body)
            .ok()
            .and_then(|t| t.token.or(t.access_token))
            .filter(|t| !t.is_empty())
            .ok_or_else(|| self.registry_error("the token service sent no token".to_owned()))
    }

    /// GETs `url`, following redirects; `authorization` goes only to `url`'s own origin, so
    /// credentials never follow a redirect to another host.
    async fn send(
        &self,
        url: Url,
        accept: Option<&str>,
        authorization: Option<&HeaderValue>,
    ) -> Result<Response, PullError> {
        let origin = url.origin();
        let mut url = url;
        let mut secure = self.base.scheme() == "https";
        for _ in 0..=MAX_REDIRECTS {
            let destination = Destination::of(&url).ok_or_else(|| {
                self.registry_error(format!(
                    "the registry sent the server to a {} URL",
                    url.scheme()
                ))
            })?;
            self.refuse_downgrade(secure, &url, &destination)?;
            secure |= url.scheme() == "https";
            if let Some(address) = destination.literal {
                self.policy
                    .check(&destination.host, destination.port, address)?;
            }
            let mut request = self.client(destination.port)?.get(url.clone());
            if let Some(accept) = accept {
                request = request.header(ACCEPT, accept);
            }
            if let Some(value) = authorization.filter(|_| url.origin() == origin) {
                request = request.header(AUTHORIZATION, value.clone());
            }
            let response = request.send().await.map_err(|e| self.request_error(&e))?;
            if !response.status().is_redirection() {
                return Ok(response);
            }
            let next = response
                .headers()
                .get(LOCATION)
                .and_then(|l| l.to_str().ok())
                .and_then(|l| url.join(l).ok());
            match next {
                Some(next) => url = next,
                None => return Ok(response),
            }
        }
        Err(self.registry_error(format!("more than {MAX_REDIRECTS} redirects")))
    }

    /// Refuses `url` when it is plain http and the exchange was `secure` so far.
    fn refuse_downgrade(
        &self,
        secure: bool,
        url: &Url,
        destination: &Destination,
    ) -> Result<(), PullError> {
        if secure && url.scheme() != "https" {
            return Err(self.registry_error(format!(
                "the registry, reached over https, sent the server to plain http at {}:{}; refused",
                destination.host, destination.port
            )));
        }
        Ok(())
    }

    fn client(&self, port: u16) -> Result<reqwest::Client, PullError> {
        let mut clients = self.clients.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(client) = clients.get(&port) {
            return Ok(client.clone());
        }
        // reqwest is built without a bundled crypto provider so that aws-lc is not needed;
        // installing ring once for the process does it, and fails harmlessly if the
        // application already installed one.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .user_agent(USER_AGENT)
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(READ_TIMEOUT)
            // Followed in `send`, where each hop is checked.
            .redirect(reqwest::redirect::Policy::none())
            // A proxy would make the connection, and the name lookup, out of the rule's sight.
            .no_proxy()
            .dns_resolver(RuleResolver {
                policy: Arc::clone(&self.policy),
                port,
            })
            .build()
            .map_err(|e| {
                self.registry_error(format!("cannot set up an HTTP client: {}", error_chain(&e)))
            })?;
        clients.insert(port, client.clone());
        Ok(client)
    }

    fn request_error(&self, err: &reqwest::Error) -> PullError {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(current) = cause {
            if let Some(refused) = current.downcast_ref::<RegistryRefused>() {
                return PullError::Refused(refused.clone());
            }
            cause = current.source();
        }
        PullError::Unreachable {
            reference: self.name.clone(),
            reason: error_chain(err),
        }
    }

    /// The error a registry's answer means when it is not the one a request expects.
    pub(crate) async fn status_error(&self, response: Response) -> PullError {
        let status = response.status();
        let codes = if status.is_client_error() && status != StatusCode::NOT_FOUND {
            error_codes(response).await
        } else {
            Vec::new()
        };
        classify(status, &codes, &self.name)
    }

    fn basic(&self, credentials: &RegistryAuth) -> Result<HeaderValue, PullError> {
        let encoded = base64::engine::general_purpose::STANDARD
            .encode(format!("{}:{}", credentials.username, credentials.password));
        let mut value = HeaderValue::from_str(&format!("Basic {encoded}"))
            .map_err(|_| self.registry_error("the credentials cannot be sent".to_owned()))?;
        value.set_sensitive(true);
        Ok(value)
    }

    fn registry_error(&self, message: String) -> PullError {
        PullError::Registry {
            reference: self.name.clone(),
            message,
        }
    }
}

/// Resolves names for connections to one port, keeping only addresses the rule allows.
#[derive(Debug)]
struct RuleResolver {
    policy: Arc<RegistryPolicy>,
    port: u16,
}

impl reqwest::dns::Resolve for RuleResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = Arc::clone(&self.policy);
        let port = self.port;
        let host = name.as_str().to_owned();
        Box::pin(async move {
            match policy.resolve(&host, port).await {
                Ok(addresses) => Ok(Box::new(addresses.into_iter()) as reqwest::dns::Addrs),
                // The refusal itself travels up the error's causes, so the pull reports it as
                // a refusal rather than as a lookup failure.
                Err(ResolveError::Refused(refused)) => Err(refused.into()),
                Err(other) => Err(other.into()),
            }
        })
    }
}

/// Reads a body of at most `limit` bytes; `None` when it is longer.
async fn read_limited(
    mut response: Response,
    limit: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if response
        .content_length()
        .is_some_and(|length| length > limit as u64)
    {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > limit {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// The `code`s of a distribution-spec error body, if the body is one.
async fn error_codes(response: Response) -> Vec<String> {
    #[derive(Deserialize)]
    struct Envelope {
        errors: Vec<Entry>,
    }
    #[derive(Deserialize)]
    struct Entry {
        code: String,
    }
    match read_limited(response, MAX_ERROR_BODY_BYTES).await {
        Ok(Some(body)) => serde_json::from_slice::<Envelope>(&body)
            .map(|e| e.errors.into_iter().map(|entry| entry.code).collect())
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// The error a registry's non-200 answer means; `codes` are from its error body.
pub(crate) fn classify(status: StatusCode, codes: &[String], name: &str) -> PullError {
    let reference = name.to_owned();
    let has = |known: &[&str]| codes.iter().any(|c| known.contains(&c.as_str()));
    match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => PullError::Unauthorized { reference },
        StatusCode::NOT_FOUND => PullError::NotFound { reference },
        _ if has(&UNAUTHORIZED_CODES) => PullError::Unauthorized { reference },
        _ if has(&NOT_FOUND_CODES) => PullError::NotFound { reference },
        _ => PullError::Registry {
            reference,
            message: describe_status(status),
        },
    }
}

/// A status and what it means for a pull, without anything the registry wrote.
pub(crate) fn describe_status(status: StatusCode) -> String {
    let meaning = match status.as_u16() {
        429 => "the registry is limiting requests; try again later",
        300..=399 => "a redirect without a usable location",
        400..=499 => "the registry refused the request",
        500..=599 => "the registry failed to answer",
        _ => "not an answer a registry gives to this request",
    };
    match status.canonical_reason() {
        Some(reason) => format!("http status {} ({reason}): {meaning}", status.as_u16()),
        None => format!("http status {}: {meaning}", status.as_u16()),
    }
}

/// What a registry's `WWW-Authenticate` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
    },
}

/// The challenges this client understands, in the order the registry gave them.
fn challenges(headers: &HeaderMap) -> Vec<Challenge> {
    headers
        .get_all(WWW_AUTHENTICATE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(parse_challenges)
        .collect()
}

/// Parses `Scheme param="value", param=value, Other ...` (RFC 9110 §11.6.1) loosely: only the
/// schemes and parameters matter, token68 forms are skipped.
fn parse_challenges(text: &str) -> Vec<Challenge> {
    let mut schemes: Vec<(String, Vec<(String, String)>)> = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(|c: char| c == ',' || c.is_ascii_whitespace());
        if rest.is_empty() {
            break;
        }
        let end = rest
            .find(|c: char| c == '=' || c == ',' || c.is_ascii_whitespace())
            .unwrap_or(rest.len());
        let (token, after) = rest.split_at(end);
        match after.trim_start().strip_prefix('=') {
            Some(value) => {
                let (value, remaining) = parse_value(value.trim_start());
                if let Some((_, params)) = schemes.last_mut() {
                    params.push((token.to_ascii_lowercase(), value));
                }
                rest = remaining;
            }
            None => {
                schemes.push((token.to_ascii_lowercase(), Vec::new()));
                rest = after;
            }
        }
    }
    schemes
        .into_iter()
        .filter_map(|(scheme, params)| {
            let param = |name: &str| {
                params
                    .iter()
                    .find(|(key, _)| key == name)
                    .map(|(_, value)| value.clone())
            };
            match scheme.as_str() {
                "basic" => Some(Challenge::Basic),
                "bearer" => Some(Challenge::Bearer {
                    realm: param("realm")?,
                    service: param("service"),
                }),
                _ => None,
            }
        })
        .collect()
}

/// A quoted string (with `\` escapes) or a bare token, and what follows it.
fn parse_value(text: &str) -> (String, &str) {
    let Some(quoted) = text.strip_prefix('"') else {
        let end = text.find(',').unwrap_or(text.len());
        return (text[..end].trim().to_owned(), &text[end..]);
    };
    let mut value = String::new();
    let mut chars = quoted.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '\\' => {
                if let Some((_, escaped)) = chars.next() {
                    value.push(escaped);
                }
            }
            '"' => return (value, &quoted[at + 1..]),
            _ => value.push(c),
        }
    }
    (value, "")
}

pub(crate) fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::test_server::fixed_server;

    fn session(registry: &str) -> Session {
        let policy = Arc::new(
            RegistryPolicy::new(vec!["127.0.0.1".parse().unwrap()], vec![], vec![]).unwrap(),
        );
        Session::new(policy, &Url::parse(registry).unwrap(), "x/y", "x/y:1", None).unwrap()
    }

    #[tokio::test]
    async fn a_registry_reached_over_https_never_leads_to_plain_http() {
        use std::sync::atomic::Ordering;
        let (port, hits) = fixed_server(
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".into(),
        )
        .await;
        let plain = Url::parse(&format!("http://127.0.0.1:{port}/v2/x/y/manifests/1")).unwrap();
        // A redirect hop, a token service or an upload location on plain http.
        let secure = session("https://127.0.0.1:1/");
        let err = secure.get(plain.clone(), None).await.unwrap_err();
        assert!(err.to_string().contains("plain http"), "{err}");
        let err = secure
            .call(Method::PUT, plain.clone(), &[], None)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("plain http"), "{err}");
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        // A registry the operator serves over plain http is reached.
        let response = session(&format!("http://127.0.0.1:{port}/"))
            .get(plain, None)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(hits.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn challenges_are_parsed() {
        assert_eq!(
            parse_challenges(
                r#"Bearer realm="https://auth.example.test/token",service="registry.example.test",scope="repository:library/ubuntu:pull""#
            ),
            [Challenge::Bearer {
                realm: "https://auth.example.test/token".into(),
                service: Some("registry.example.test".into()),
            }]
        );
        assert_eq!(
            parse_challenges(r#"Basic realm="sandbar-e2e""#),
            [Challenge::Basic]
        );
        assert_eq!(
            parse_challenges(r#"Negotiate abc==, basic realm="a, b", BEARER realm=x"#),
            [
                Challenge::Basic,
                Challenge::Bearer {
                    realm: "x".into(),
                    service: None
                }
            ]
        );
        assert_eq!(
            parse_challenges(r#"Bearer realm="a\"b", service="s""#),
            [Challenge::Bearer {
                realm: "a\"b".into(),
                service: Some("s".into())
            }]
        );
        // A bearer challenge without a realm leads nowhere.
        assert!(parse_challenges(r#"Bearer service="s""#).is_empty());
        assert!(parse_challenges("").is_empty());
        assert!(parse_challenges(r#"realm="orphan""#).is_empty());
    }

    #[test]
    fn statuses_are_classified_without_remote_text() {
        let codes = |list: &[&str]| list.iter().map(|c| (*c).to_owned()).collect::<Vec<_>>();
        let classified = |status: u16, list: &[&str]| {
            classify(StatusCode::from_u16(status).unwrap(), &codes(list), "r")
        };
        assert!(matches!(classified(404, &[]), PullError::NotFound { .. }));
        assert!(matches!(
            classified(401, &[]),
            PullError::Unauthorized { .. }
        ));
        assert!(matches!(
            classified(403, &[]),
            PullError::Unauthorized { .. }
        ));
        assert!(matches!(
            classified(400, &["NAME_UNKNOWN"]),
            PullError::NotFound { .. }
        ));
        assert!(matches!(
            classified(400, &["DENIED"]),
            PullError::Unauthorized { .. }
        ));
        let err = classified(500, &[]);
        assert_eq!(
            err.to_string(),
            "registry error pulling r: http status 500 (Internal Server Error): the registry failed to answer"
        );
        assert!(
            classified(429, &["TOOMANYREQUESTS"])
                .to_string()
                .contains("limiting requests")
        );
        assert!(classified(302, &[]).to_string().contains("http status 302"));
        assert!(classified(206, &[]).to_string().contains("http status 206"));
        assert_eq!(
            describe_status(StatusCode::from_u16(599).unwrap()),
            "http status 599: the registry failed to answer"
        );
    }
}
