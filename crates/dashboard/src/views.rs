//! The pages and fragments, as maud templates: every interpolated value is escaped by maud
//! (`&`, `<`, `>`, `"` and `'` in text and in quoted attributes), and nothing here marks
//! tenant data as pre-escaped.

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};
use sandbar_core::sandboxes::{Page, SnapshotInfo};
use sandbar_core::{
    ApiKeyInfo, BuildLogEntry, BuildRecord, MetricPoint, Sandbox, SandboxEvent, SandboxLogEntry,
    Team, TeamMetricPoint, Template,
};

/// htmx without inline styles or evaluated code, so the CSP needs neither.
const HTMX_CONFIG: &str = r#"{"includeIndicatorStyles":false,"allowEval":false,"allowScriptTags":false,"selfRequestsOnly":true}"#;

/// One entry of a listed directory.
#[derive(Debug)]
pub(crate) struct Entry {
    pub name: String,
    pub path: String,
    pub is_dir: bool,
    pub size: u64,
}

/// Which page a signed-in page is, for its navigation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Overview,
    Sandboxes,
    Templates,
    Snapshots,
    Volumes,
    Events,
    Webhooks,
    Usage,
    Nodes,
    Keys,
}

/// A whole page. `csrf` is the session's token when signed in: htmx sends it with every
/// request the page makes.
pub(crate) fn page(
    title: &str,
    signed_in: Option<(&str, Nav)>,
    extra_head: Markup,
    body: Markup,
) -> Markup {
    let headers =
        signed_in.map(|(csrf, _)| serde_json::json!({ "X-CSRF-Token": csrf }).to_string());
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="htmx-config" content=(HTMX_CONFIG);
                title { (title) " · Sandbar" }
                link rel="stylesheet" href="/dashboard/assets/app.css";
                script src="/dashboard/assets/htmx.min.js" defer {}
                script src="/dashboard/assets/app.js" defer {}
                (extra_head)
            }
            body hx-headers=[headers] {
                header {
                    strong { "Sandbar" }
                    @if let Some((_, nav)) = signed_in {
                        nav {
                            a href="/dashboard/" aria-current=[(nav == Nav::Overview).then_some("page")] { "Overview" }
                            a href="/dashboard/sandboxes" aria-current=[(nav == Nav::Sandboxes).then_some("page")] { "Sandboxes" }
                            a href="/dashboard/templates" aria-current=[(nav == Nav::Templates).then_some("page")] { "Templates" }
                            a href="/dashboard/snapshots" aria-current=[(nav == Nav::Snapshots).then_some("page")] { "Snapshots" }
                            a href="/dashboard/volumes" aria-current=[(nav == Nav::Volumes).then_some("page")] { "Volumes" }
                            a href="/dashboard/events" aria-current=[(nav == Nav::Events).then_some("page")] { "Events" }
                            a href="/dashboard/webhooks" aria-current=[(nav == Nav::Webhooks).then_some("page")] { "Webhooks" }
                            a href="/dashboard/usage" aria-current=[(nav == Nav::Usage).then_some("page")] { "Usage" }
                            a href="/dashboard/nodes" aria-current=[(nav == Nav::Nodes).then_some("page")] { "Nodes" }
                            a href="/dashboard/keys" aria-current=[(nav == Nav::Keys).then_some("page")] { "API keys" }
                        }
                        button #sign-out hx-post="/dashboard/logout" { "Sign out" }
                    }
                }
                main {
                    div #errors aria-live="polite" {}
                    (body)
                }
            }
        }
    }
}

/// A page that only says what went wrong.
pub(crate) fn error_page(signed_in: Option<(&str, Nav)>, message: &str) -> Markup {
    page(
        "Error",
        signed_in,
        html! {},
        html! {
            div.error role="alert" { (message) }
            p { a href="/dashboard/" { "Back to the overview" } }
        },
    )
}

pub(crate) fn login(message: Option<&str>) -> Markup {
    page(
        "Sign in",
        None,
        html! {},
        html! {
            div.login {
                h1 { "Sign in" }
                @if let Some(message) = message {
                    div.error role="alert" { (message) }
                }
                form method="post" action="/dashboard/login" {
                    label {
                        "Team API key (e2b_…) or access token (sk_e2b_…)"
                        input #key type="password" name="key" autocomplete="off" required autofocus;
                    }
                    p { button type="submit" { "Sign in" } }
                }
            }
        },
    )
}

fn ago(at: DateTime<Utc>) -> String {
    let secs = (Utc::now() - at).num_seconds().max(0);
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m", secs / 60),
        3600..86400 => format!("{}h{}m", secs / 3600, secs % 3600 / 60),
        _ => format!("{}d", secs / 86400),
    }
}

fn when(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes >> 20)
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

fn state_name(sandbox: &Sandbox) -> &'static str {
    sandbox.state().as_str()
}

fn template_name(sandbox: &Sandbox) -> &str {
    sandbox.alias.as_deref().unwrap_or(&sandbox.template_id)
}

/// What the Overview shows.
#[derive(Debug)]
pub(crate) struct Overview {
    pub creates_per_minute: f64,
    pub running: usize,
    pub paused: usize,
    pub memory: Option<sandbar_core::MemoryReport>,
    pub disks: sandbar_core::DiskReport,
    pub failed_builds: Vec<Template>,
    pub recent: Vec<Sandbox>,
}

pub(crate) fn overview(csrf: &str, o: &Overview) -> Markup {
    page(
        "Overview",
        Some((csrf, Nav::Overview)),
        html! {},
        html! {
            h1 { "Overview" }
            div.cards {
                div.card #running-count { b { (o.running) } "running sandboxes" }
                div.card #paused-count { b { (o.paused) } "paused sandboxes" }
                div.card #create-rate { b { (format!("{:.1}", o.creates_per_minute)) } "creates a minute (last minute)" }
                @if let Some(m) = &o.memory {
                    div.card { b { (gib(m.promised_bytes)) } "memory promised of " (gib(m.promise_limit_bytes)) " (" (gib(m.available_bytes)) " available)" }
                }
                @if let Some(pool) = &o.disks.pool {
                    div.card { b { (gib(o.disks.pool_promised_bytes)) } "disk promised of " (gib(o.disks.pool_promise_limit_bytes)) " (" (gib(pool.free_bytes)) " free)" }
                }
            }
            p.muted { "Memory and disk are the node's: every team's sandboxes share them." }
            h2 { "Recent sandboxes" }
            (sandbox_table(&o.recent))
            h2 { "Recent failures" }
            @if o.failed_builds.is_empty() {
                p.muted { "No failed template builds." }
            } @else {
                div.scroll { table {
                    thead { tr { th { "Template" } th { "Build" } th { "Error" } } }
                    tbody {
                        @for t in &o.failed_builds {
                            tr {
                                td { (t.aliases.first().unwrap_or(&t.id)) }
                                td { a href=(format!("/dashboard/templates/{}/builds/{}", t.id, t.build_id)) { (t.build_id) } }
                                td { (t.build_error.as_deref().unwrap_or("")) }
                            }
                        }
                    }
                } }
            }
        },
    )
}

pub(crate) fn sandboxes(csrf: &str, filter: &str, next: &str, listed: &Page<Sandbox>) -> Markup {
    page(
        "Sandboxes",
        Some((csrf, Nav::Sandboxes)),
        html! {},
        html! {
            h1 { "Sandboxes" }
            details #create {
                summary { "New sandbox" }
                form.row #create-form hx-post="/dashboard/sandboxes" {
                    label { "Template" input name="template" value="base" required; }
                    label { "Timeout (s)" input name="timeout" type="number" value="300" min="1"; }
                    label { "Metadata (key=value, one a line)" textarea name="metadata" rows="2" {} }
                    button type="submit" { "Create" }
                }
            }
            form.row #filter method="get" action="/dashboard/sandboxes" {
                label { "Metadata filter (key=value, comma-separated)"
                    // A new filter starts again from the first page.
                    input name="metadata" value=(filter) hx-get="/dashboard/sandboxes/rows"
                        hx-trigger="input changed delay:300ms" hx-target="#rows" hx-include="#filter-metadata";
                }
                input #filter-metadata type="hidden" name="next" value="";
            }
            div #rows hx-get="/dashboard/sandboxes/rows" hx-trigger="every 1s"
                hx-include="#filter input[name=metadata], #filter-page" {
                (sandbox_rows(filter, next, listed))
            }
        },
    )
}

/// The polled part of the list: one page of rows and the links to the first and next pages.
/// It carries the token of the page it shows, which the next poll sends back: a filter
/// changed since answers the first page, and the polls follow it there.
pub(crate) fn sandbox_rows(filter: &str, next: &str, listed: &Page<Sandbox>) -> Markup {
    let link = |token: &str| {
        let mut query = url::form_urlencoded::Serializer::new(String::new());
        if !filter.is_empty() {
            query.append_pair("metadata", filter);
        }
        if !token.is_empty() {
            query.append_pair("next", token);
        }
        format!("/dashboard/sandboxes?{}", query.finish())
    };
    html! {
        input #filter-page type="hidden" name="next" value=(next);
        p.muted #list-count {
            (listed.items.len()) " shown of " (listed.total) " (" (listed.running_total) " running)"
            @if !next.is_empty() { " · " a #first-page href=(link("")) { "First page" } }
            @if let Some(token) = &listed.next_token { " · " a #next-page href=(link(token)) { "Next page" } }
        }
        (sandbox_table(&listed.items))
    }
}

pub(crate) fn sandbox_table(items: &[Sandbox]) -> Markup {
    html! {
        @if items.is_empty() {
            p.muted #no-sandboxes { "No sandboxes." }
        } @else {
            div.scroll { table #sandbox-table {
                thead { tr { th { "Sandbox" } th { "State" } th { "Template" } th { "Age" } th { "Ends" } th.wide { "Metadata" } } }
                tbody {
                    @for s in items {
                        tr data-sandbox=(s.id) {
                            td { a.mono href=(format!("/dashboard/sandboxes/{}", s.id)) { (s.id) } }
                            td.(format!("state-{}", state_name(s))) { (state_name(s)) }
                            td { (template_name(s)) }
                            td { (ago(s.started_at)) }
                            td { (when(s.end_at)) }
                            td.wide.mono {
                                @for (k, v) in &s.metadata { span.meta { (k) "=" (v) } " " }
                            }
                        }
                    }
                }
            } }
        }
    }
}

/// The sandbox's page: details, actions, chart, log, files and terminal.
pub(crate) fn sandbox(
    csrf: &str,
    s: &Sandbox,
    metrics: &[MetricPoint],
    logs: &[SandboxLogEntry],
) -> Markup {
    let socket = format!("/dashboard/sandboxes/{}/terminal?csrf={}", s.id, csrf);
    page(
        &s.id,
        Some((csrf, Nav::Sandboxes)),
        html! {
            link rel="stylesheet" href="/dashboard/assets/xterm.css";
            script src="/dashboard/assets/xterm.js" defer {}
            script src="/dashboard/assets/addon-fit.js" defer {}
            script src="/dashboard/assets/addon-attach.js" defer {}
        },
        html! {
            h1 { "Sandbox " span.mono { (s.id) } }
            (sandbox_state(s))
            h2 { "Details" }
            div.scroll { table {
                tbody {
                    tr { th { "Template" } td { (template_name(s)) " " span.muted.mono { (s.template_id) } } }
                    tr { th { "Started" } td { (when(s.started_at)) " (" (ago(s.started_at)) " ago)" } }
                    tr { th { "CPU / memory / disk" } td { (s.cpu_count) " vCPU, " (s.memory_mb) " MiB, " (s.disk_size_mb) " MiB" } }
                    tr { th { "Internet" } td { (if s.allow_internet_access { "allowed" } else { "cut" }) } }
                    tr { th { "Metadata" } td #metadata .mono {
                        @for (k, v) in &s.metadata { div { (k) "=" (v) } }
                    } }
                }
            } }
            h2 { "CPU, memory and disk" }
            (live_chart(&s.id, metrics))
            h2 { "Terminal" }
            button #open-terminal data-open-terminal { "Open terminal" }
            div #terminal hidden data-socket=(socket) {}
            h2 { "Files" }
            div #files hx-get=(format!("/dashboard/sandboxes/{}/files", s.id)) hx-trigger="load" {
                p.muted { "Loading…" }
            }
            h2 { "Log" }
            form.row #log-filter {
                label { "Level at least"
                    select name="level" hx-get=(format!("/dashboard/sandboxes/{}/log", s.id)) hx-target="#log-box"
                        hx-swap="outerHTML" hx-include="#log-filter" {
                        option value="" { "any" }
                        @for level in ["debug", "info", "warn", "error"] { option value=(level) { (level) } }
                    }
                }
                label { "Message contains"
                    input name="search" type="search" hx-get=(format!("/dashboard/sandboxes/{}/log", s.id))
                        hx-trigger="input changed delay:300ms" hx-target="#log-box" hx-swap="outerHTML"
                        hx-include="#log-filter";
                }
            }
            (live_log(&s.id, logs))
        },
    )
}

/// The state and action buttons, polled so a pause from elsewhere shows.
pub(crate) fn sandbox_state(s: &Sandbox) -> Markup {
    let base = format!("/dashboard/sandboxes/{}", s.id);
    let state = state_name(s);
    html! {
        section #state hx-get=(format!("{base}/state")) hx-trigger="every 1s" hx-swap="outerHTML" {
            p {
                "State: " span #sandbox-state .(format!("state-{state}")) { (state) }
                " · ends " span #ends { (when(s.end_at)) }
            }
            div.row {
                @if state == "running" {
                    button #pause hx-post=(format!("{base}/pause")) hx-target="#state" hx-swap="outerHTML" { "Pause" }
                } @else {
                    button #resume hx-post=(format!("{base}/resume")) hx-target="#state" hx-swap="outerHTML" { "Resume" }
                }
                form.row #extend-form hx-post=(format!("{base}/extend")) hx-target="#state" hx-swap="outerHTML" {
                    input name="timeout" type="number" value="300" min="1" aria-label="seconds from now";
                    button #extend type="submit" { "Set timeout" }
                }
                @if state == "running" {
                    button #snapshot hx-post=(format!("{base}/snapshot")) hx-disabled-elt="this" { "Snapshot" }
                    button #fork hx-post=(format!("{base}/fork")) hx-disabled-elt="this" { "Fork" }
                }
                button.danger #kill hx-post=(format!("{base}/kill")) { "Kill" }
            }
        }
    }
}

/// The chart, polled every two seconds (a sample is taken every few).
pub(crate) fn live_chart(id: &str, points: &[MetricPoint]) -> Markup {
    html! {
        div #chart-box hx-get=(format!("/dashboard/sandboxes/{id}/chart")) hx-trigger="every 2s" hx-swap="outerHTML" {
            (chart(points))
        }
    }
}

/// The log's newest lines, oldest first, polled every two seconds with the page's filters.
pub(crate) fn live_log(id: &str, logs: &[SandboxLogEntry]) -> Markup {
    html! {
        div #log-box hx-get=(format!("/dashboard/sandboxes/{id}/log")) hx-trigger="every 2s"
            hx-swap="outerHTML" hx-include="#log-filter" {
            @if logs.is_empty() {
                p.muted #no-log { "No log lines match." }
            }
            pre #log { @for l in logs { (when(l.at)) " " (l.level.as_str()) " " (l.message) "\n" } }
        }
    }
}

/// CPU (percent), memory (of the limit) and disk (of the quota) as three lines of an SVG drawn
/// on the server.
fn chart(points: &[MetricPoint]) -> Markup {
    if points.len() < 2 {
        return html! { p.muted #chart { "Not enough samples yet (one every few seconds)." } };
    }
    let n = points.len() - 1;
    let line = |value: &dyn Fn(&MetricPoint) -> f64| -> String {
        points
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let x = i as f64 * 300.0 / n as f64;
                let y = 100.0 - value(p).clamp(0.0, 100.0);
                format!("{x:.1},{y:.1}")
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let cpu = line(&|p| p.cpu_used_pct);
    let mem = line(&|p| share(p.mem_used, p.mem_total));
    let disk = line(&|p| share(p.disk_used, p.disk_total));
    let last = &points[n];
    html! {
        svg.chart #chart viewBox="0 0 300 100" preserveAspectRatio="none" role="img" aria-label="CPU, memory and disk use" {
            polyline.cpu points=(cpu) {}
            polyline.mem points=(mem) {}
            polyline.disk points=(disk) {}
        }
        p.muted #chart-last {
            "CPU " (format!("{:.1}", last.cpu_used_pct)) "% (blue) · memory " (mib(last.mem_used)) " of "
            (mib(last.mem_total)) " (green) · disk " (mib(last.disk_used)) " of " (mib(last.disk_total)) " (orange)"
        }
    }
}

/// `used` as a percentage of `total`, 0 when nothing is known of the total.
fn share(used: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        used as f64 * 100.0 / total as f64
    }
}

/// The files panel when a listing failed: the reason, and a next try, made by the panel
/// itself after a short wait while `again` names its number, else by the user's click.
pub(crate) fn file_list_failed(id: &str, dir: &str, reason: &str, again: Option<u32>) -> Markup {
    let retry = |failed: u32| {
        let query = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("path", dir)
            .append_pair("failed", &failed.to_string())
            .finish();
        format!("/dashboard/sandboxes/{id}/files?{query}")
    };
    html! {
        p.error #files-failed role="alert" { "Cannot list " code { (dir) } ": " (reason) }
        @if let Some(failed) = again {
            p.muted hx-get=(retry(failed)) hx-trigger="load delay:2s" hx-target="#files" { "Trying again…" }
        } @else {
            button #files-retry hx-get=(retry(0)) hx-target="#files" { "Try again" }
        }
    }
}

pub(crate) fn file_list(id: &str, dir: &str, entries: &[Entry]) -> Markup {
    let base = format!("/dashboard/sandboxes/{id}/files");
    let query = |path: &str| {
        url::form_urlencoded::Serializer::new(String::new())
            .append_pair("path", path)
            .finish()
    };
    let parent = match dir.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) => Some("/".to_owned()),
        Some((p, _)) => Some(p.to_owned()),
        None => None,
    };
    html! {
        p { "Directory " code #cwd { (dir) } }
        @if let Some(parent) = parent {
            p { a href="#" hx-get=(format!("{base}?{}", query(&parent))) hx-target="#files" { "↑ up" } }
        }
        form.row #upload-form hx-post=(format!("{base}/upload")) hx-encoding="multipart/form-data" hx-target="#files" {
            input type="hidden" name="dir" value=(dir);
            input #upload-file type="file" name="file" required;
            button type="submit" { "Upload" }
        }
        div.scroll { table #file-table {
            thead { tr { th { "Name" } th { "Size" } th {} } }
            tbody {
                @for e in entries {
                    tr data-name=(e.name) {
                        @if e.is_dir {
                            td { a href="#" hx-get=(format!("{base}?{}", query(&e.path))) hx-target="#files" { (e.name) "/" } }
                            td {}
                        } @else {
                            td { a.download href=(format!("{base}/download?{}", query(&e.path))) download { (e.name) } }
                            td { (e.size) }
                        }
                        td {
                            button.danger.delete hx-post=(format!("{base}/delete")) hx-target="#files"
                                hx-vals=(serde_json::json!({ "path": e.path }).to_string()) { "Delete" }
                        }
                    }
                }
            }
        } }
    }
}

pub(crate) fn templates(csrf: &str, list: &[(Template, Vec<BuildRecord>)]) -> Markup {
    page(
        "Templates",
        Some((csrf, Nav::Templates)),
        html! {},
        html! {
            h1 { "Templates" }
            details #template-create {
                summary { "New template from a Dockerfile" }
                form #dockerfile-form hx-post="/dashboard/templates" {
                    label { "Name" input name="name" required placeholder="my-template"; }
                    label { "Dockerfile (no build context: COPY needs the SDK or CLI)"
                        textarea #dockerfile name="dockerfile" rows="8" required spellcheck="false" { "FROM \nRUN " }
                    }
                    // Read in the browser into the text above, which is what is sent.
                    label { "or load it from a file" input #dockerfile-file type="file" data-load-into="dockerfile"; }
                    button type="submit" hx-disabled-elt="this" { "Build" }
                }
            }
            div.scroll { table #template-table {
                thead { tr { th { "Template" } th { "Status" } th { "Resources" } th.wide { "Updated" } th { "Builds" } } }
                tbody {
                    @for (t, builds) in list {
                        tr {
                            td { (t.aliases.first().unwrap_or(&t.id)) br; span.muted.mono { (t.id) } }
                            td { (t.build_status.as_str()) }
                            td { (t.cpu_count) " vCPU, " (t.memory_mb) " MiB" }
                            td.wide { (when(t.updated_at)) }
                            td {
                                @for b in builds.iter().take(5) {
                                    div { a.mono href=(format!("/dashboard/templates/{}/builds/{}", t.id, b.id)) { (b.id) } " " (b.status.as_str()) }
                                }
                            }
                        }
                    }
                }
            } }
        },
    )
}

pub(crate) fn build(csrf: &str, build: &BuildRecord, logs: &[BuildLogEntry]) -> Markup {
    page(
        "Build",
        Some((csrf, Nav::Templates)),
        html! {},
        html! {
            h1 { "Build " span.mono { (build.id) } }
            p { "Template " span.mono { (build.template_id) } }
            (build_log(build, logs))
        },
    )
}

/// The build's status and log, polled every second until the build ends.
pub(crate) fn build_log(build: &BuildRecord, logs: &[BuildLogEntry]) -> Markup {
    let url = format!(
        "/dashboard/templates/{}/builds/{}/log",
        build.template_id, build.id
    );
    let status = build.status.as_str();
    let going = matches!(status, "waiting" | "building");
    html! {
        section #build-log hx-get=[going.then_some(url)] hx-trigger=[going.then_some("every 1s")] hx-swap="outerHTML" {
            p { "Status: " b #build-status { (status) } }
            @if let Some(f) = &build.failure { div.error { (f.message) } }
            pre { @for l in logs { (when(l.timestamp)) " " (l.message) "\n" } }
        }
    }
}

pub(crate) fn keys(csrf: &str, list: &[ApiKeyInfo], created: Option<(&str, &str)>) -> Markup {
    page(
        "API keys",
        Some((csrf, Nav::Keys)),
        html! {},
        html! {
            h1 { "API keys" }
            form.row #key-form hx-post="/dashboard/keys" hx-target="#keys" hx-swap="outerHTML" {
                label { "Name" input name="name" required; }
                button type="submit" { "Create key" }
            }
            (key_list(list, created))
        },
    )
}

pub(crate) fn key_list(list: &[ApiKeyInfo], created: Option<(&str, &str)>) -> Markup {
    html! {
        section #keys {
            @if let Some((name, key)) = created {
                div.notice #new-key {
                    "Key " b { (name) } " created. Copy it now: it is not shown again."
                    pre.mono #new-key-value { (key) }
                }
            }
            div.scroll { table #key-table {
                thead { tr { th { "Name" } th { "Key" } th.wide { "Created" } th.wide { "Last used" } th {} } }
                tbody {
                    @for k in list {
                        tr data-key=(k.name) {
                            td { (k.name) }
                            td.mono { (k.mask.display()) }
                            td.wide { (when(k.created_at)) }
                            td.wide { (k.last_used.map(when).unwrap_or_else(|| "never".to_owned())) }
                            td { button.danger.revoke hx-post=(format!("/dashboard/keys/{}/revoke", k.id)) hx-target="#keys" hx-swap="outerHTML" { "Revoke" } }
                        }
                    }
                }
            } }
        }
    }
}

/// The team's snapshots, each with a form that starts a sandbox from it.
pub(crate) fn snapshots(csrf: &str, list: &[SnapshotInfo]) -> Markup {
    page(
        "Snapshots",
        Some((csrf, Nav::Snapshots)),
        html! {},
        html! {
            h1 { "Snapshots" }
            @if list.is_empty() {
                p.muted #no-snapshots { "No snapshots yet: a running sandbox's page has a Snapshot button." }
            } @else {
                div.scroll { table #snapshot-table {
                    thead { tr { th { "Snapshot" } th { "Of sandbox" } th.wide { "Taken" } th { "" } } }
                    tbody {
                        @for s in list {
                            tr data-snapshot=(s.template_id) {
                                td { span.mono { (s.snapshot_id) } }
                                td { a.mono href=(format!("/dashboard/sandboxes/{}", s.sandbox_id)) { (s.sandbox_id) } }
                                td.wide { (when(s.created_at)) " (" (ago(s.created_at)) " ago)" }
                                td { div.row {
                                    form hx-post="/dashboard/sandboxes" {
                                        input type="hidden" name="template" value=(s.template_id);
                                        button.start-from type="submit" hx-disabled-elt="this" { "Start a sandbox" }
                                    }
                                    button.danger.delete-snapshot hx-post=(format!("/dashboard/snapshots/{}/delete", s.template_id)) { "Delete" }
                                } }
                            }
                        }
                    }
                } }
            }
        },
    )
}

/// The team's concurrent sandboxes and start rate over the last `days`, and its limits.
pub(crate) fn usage(csrf: &str, team: &Team, days: i64, points: &[TeamMetricPoint]) -> Markup {
    let peak = points
        .iter()
        .map(|p| p.concurrent_sandboxes)
        .max()
        .unwrap_or(0);
    let peak_rate = points
        .iter()
        .map(|p| p.sandbox_start_rate)
        .fold(0.0_f64, f64::max);
    page(
        "Usage",
        Some((csrf, Nav::Usage)),
        html! {},
        html! {
            h1 { "Usage" }
            h2 { "Limits" }
            div.scroll { table #limits { tbody {
                tr { th { "Sandboxes at once" } td { (team.limits.max_concurrent_sandboxes) } }
                tr { th { "Longest sandbox timeout" } td { (team.limits.max_sandbox_timeout_secs) " s" } }
                tr { th { "API requests a minute" } td { (or_unlimited(team.limits.requests_per_minute, "")) } }
                tr { th { "vCPU a sandbox" } td { (or_unlimited(team.limits.max_vcpu, "")) } }
                tr { th { "Memory a sandbox" } td { (or_unlimited(team.limits.max_memory_mb, " MiB")) } }
                tr { th { "Disk a sandbox" } td { (or_unlimited(team.limits.max_disk_mb, " MiB")) } }
            } } }
            h2 { "Last " (days) " days" }
            p #usage-peak { "Peak: " (peak) " sandboxes at once, " (format!("{:.2}", peak_rate * 60.0)) " starts a minute." }
            (series_chart(
                "concurrent sandboxes",
                &points.iter().map(|p| f64::from(p.concurrent_sandboxes)).collect::<Vec<_>>(),
            ))
            (series_chart(
                "sandbox starts a second",
                &points.iter().map(|p| p.sandbox_start_rate).collect::<Vec<_>>(),
            ))
            @if let (Some(first), Some(last)) = (points.first(), points.last()) {
                p.muted { (when(first.at)) " to " (when(last.at)) }
            }
        },
    )
}

/// One series as a line scaled to its own maximum, drawn on the server.
fn series_chart(label: &str, values: &[f64]) -> Markup {
    if values.len() < 2 {
        return html! { p.muted { "No " (label) " recorded yet." } };
    }
    let top = values
        .iter()
        .copied()
        .fold(0.0_f64, f64::max)
        .max(f64::MIN_POSITIVE);
    let n = (values.len() - 1) as f64;
    let points = values
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{:.1},{:.1}", i as f64 * 300.0 / n, 100.0 - v / top * 100.0))
        .collect::<Vec<_>>()
        .join(" ");
    html! {
        svg.chart viewBox="0 0 300 100" preserveAspectRatio="none" role="img" aria-label=(label) {
            polyline.cpu points=(points) {}
        }
        p.muted { (label) ", up to " (format!("{top:.2}")) }
    }
}

/// A team limit where 0 leaves only the server's own.
fn or_unlimited(limit: u32, unit: &str) -> String {
    if limit == 0 {
        "no team limit (the server's own)".to_owned()
    } else {
        format!("{limit}{unit}")
    }
}

/// The team's latest lifecycle events, newest first.
pub(crate) fn events(csrf: &str, events: &[SandboxEvent]) -> Markup {
    page(
        "Events",
        Some((csrf, Nav::Events)),
        html! {},
        html! {
            h1 { "Events" }
            p.muted { "The latest " (events.len()) ", also at " span.mono { "GET /events/sandboxes" } "." }
            @if events.is_empty() {
                p.muted #no-events { "No sandbox events yet." }
            } @else {
                div.scroll { table #event-table {
                    thead { tr { th { "When" } th { "Event" } th { "Sandbox" } th.wide { "Template" } } }
                    tbody {
                        @for e in events {
                            tr data-event=(e.event_type.as_str()) data-sandbox=(e.sandbox_id) {
                                td { (when(e.timestamp)) }
                                td { (e.event_type.as_str().trim_start_matches("sandbox.lifecycle.")) }
                                td { a.mono href=(format!("/dashboard/sandboxes/{}", e.sandbox_id)) { (e.sandbox_id) } }
                                td.wide.mono { (e.sandbox_template_id) }
                            }
                        }
                    }
                } }
            }
        },
    )
}

/// The team's webhooks with a form to register one, each with its latest attempts.
pub(crate) fn webhooks(
    csrf: &str,
    list: &[(
        sandbar_core::webhooks::Webhook,
        Vec<sandbar_core::webhooks::WebhookDelivery>,
    )],
) -> Markup {
    page(
        "Webhooks",
        Some((csrf, Nav::Webhooks)),
        html! {},
        html! {
            h1 { "Webhooks" }
            details #webhook-create {
                summary { "Register a webhook" }
                form #webhook-form hx-post="/dashboard/webhooks" {
                    label { "Name" input name="name" required; }
                    label { "URL" input name="url" type="url" required placeholder="https://…"; }
                    label { "Signature secret (8 to 256 bytes)" input name="secret" type="password" required minlength="8"; }
                    fieldset {
                        legend { "Events" }
                        @for name in ["created", "updated", "paused", "resumed", "checkpointed", "killed"] {
                            label.inline { input type="checkbox" name=(name) checked; " " (name) }
                        }
                    }
                    button type="submit" { "Register" }
                }
            }
            @if list.is_empty() {
                p.muted #no-webhooks { "No webhooks yet." }
            }
            @for (hook, log) in list {
                section.webhook data-webhook=(hook.name) {
                    h2 { (hook.name) " " span.muted { (if hook.enabled { "enabled" } else { "disabled" }) } }
                    p.mono { (hook.url) }
                    p.muted { @for e in &hook.events { (e.as_str().trim_start_matches("sandbox.lifecycle.")) " " } }
                    button.danger.delete-webhook hx-post=(format!("/dashboard/webhooks/{}/delete", hook.id)) { "Delete" }
                    @if log.is_empty() {
                        p.muted { "Nothing delivered yet." }
                    } @else {
                        div.scroll { table.deliveries {
                            thead { tr { th { "When" } th { "Event" } th { "Attempt" } th { "Answer" } } }
                            tbody {
                                @for d in log {
                                    tr.delivery data-delivered=(d.delivered()) {
                                        td { (when(d.at)) }
                                        td { (d.event_type.as_str().trim_start_matches("sandbox.lifecycle.")) }
                                        td { (d.attempt) }
                                        td {
                                            @if let Some(code) = d.status_code { (code) }
                                            @if let Some(error) = &d.error { " " (error) }
                                        }
                                    }
                                }
                            }
                        } }
                    }
                }
            }
        },
    )
}

/// The team's volumes, with a form to make one.
pub(crate) fn volumes(csrf: &str, list: &[sandbar_core::Volume]) -> Markup {
    page(
        "Volumes",
        Some((csrf, Nav::Volumes)),
        html! {},
        html! {
            h1 { "Volumes" }
            form.row #volume-form hx-post="/dashboard/volumes" {
                label { "Name" input name="name" required; }
                button type="submit" { "Create volume" }
            }
            @if list.is_empty() {
                p.muted #no-volumes { "No volumes yet." }
            } @else {
                div.scroll { table #volume-table {
                    thead { tr { th { "Name" } th { "ID" } th.wide { "Created" } th {} } }
                    tbody {
                        @for v in list {
                            tr data-volume=(v.name) {
                                td { a href=(format!("/dashboard/volumes/{}", v.id)) { (v.name) } }
                                td.mono { (v.id) }
                                td.wide { (when(v.created_at)) }
                                td { button.danger.delete-volume hx-post=(format!("/dashboard/volumes/{}/delete", v.id)) { "Delete" } }
                            }
                        }
                    }
                } }
            }
        },
    )
}

/// One directory of a volume: subdirectories to open, files to download.
pub(crate) fn volume(
    csrf: &str,
    volume: &sandbar_core::Volume,
    dir: &str,
    entries: &[sandbar_core::volumes::EntryStat],
) -> Markup {
    let base = format!("/dashboard/volumes/{}", volume.id);
    let encode = |p: &str| {
        percent_encoding::utf8_percent_encode(p, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let parent = dir
        .trim_end_matches('/')
        .rsplit_once('/')
        .map(|(p, _)| if p.is_empty() { "/" } else { p });
    page(
        &volume.name,
        Some((csrf, Nav::Volumes)),
        html! {},
        html! {
            h1 { "Volume " (volume.name) }
            p { "Directory " span.mono #volume-dir { (dir) }
                @if let Some(parent) = parent { " · " a href=(format!("{base}?path={}", encode(parent))) { "up" } }
            }
            @if entries.is_empty() {
                p.muted #empty-dir { "Empty." }
            } @else {
                div.scroll { table #volume-files {
                    thead { tr { th { "Name" } th { "Size" } th.wide { "Modified" } } }
                    tbody {
                        @for e in entries {
                            tr data-entry=(e.name) {
                                td {
                                    @match e.kind {
                                        sandbar_core::volumes::EntryKind::Directory => {
                                            a.open-dir href=(format!("{base}?path={}", encode(&e.path))) { (e.name) "/" }
                                        }
                                        sandbar_core::volumes::EntryKind::File => {
                                            a.download href=(format!("{base}/download?path={}", encode(&e.path))) { (e.name) }
                                        }
                                        _ => { (e.name) }
                                    }
                                }
                                td { (e.size) }
                                td.wide { (when(e.mtime)) }
                            }
                        }
                    }
                } }
            }
        },
    )
}

/// One node as the Nodes page shows it. On a single host the server is its one node, with no
/// lease and no build slots reported.
#[derive(Debug)]
pub(crate) struct NodeRow {
    pub id: String,
    /// When the lease ends (a past time: lost since then); `None` on a single host.
    pub lease_until: Option<DateTime<Utc>>,
    pub started_at: Option<DateTime<Utc>>,
    /// What the node measured of itself; its template ids are not shown, `templates` is.
    pub report: sandbar_core::NodeReport,
    /// Names of the templates the team can use whose layers the node holds; `None` where the
    /// node does not report them.
    pub templates: Option<Vec<String>>,
}

pub(crate) fn nodes(csrf: &str, clustered: bool, rows: &[NodeRow]) -> Markup {
    let now = Utc::now();
    page(
        "Nodes",
        Some((csrf, Nav::Nodes)),
        html! {},
        html! {
            h1 { "Nodes" }
            @if clustered {
                p.muted { "The cluster's nodes as this API host last read them from the database (every second). A node whose lease ran out is lost: its sandboxes wait for it or for a take-over." }
            } @else {
                p.muted { "A single host: this server is its own node." }
            }
            div.scroll { table #node-table {
                thead { tr {
                    th { "Node" } th { "State" } th { "Sandboxes" } th { "Memory promised / limit" }
                    th { "Memory available / total" } th { "Disk promised / limit" } th { "Disk pool free / size" }
                    th { "Builds running / waiting / slots" } th { "Templates present" }
                } }
                tbody {
                    @for n in rows {
                        tr data-node=(n.id) {
                            td.mono { (n.id) }
                            td.node-state {
                                @match n.lease_until {
                                    None => { "running" }
                                    Some(until) if until > now => { "live" small.muted { " (lease " (ago_until(now, until)) ", started " (ago(n.started_at.unwrap_or(now))) " ago)" } }
                                    Some(until) => { "lost" small.muted { " (since " (when(until)) ")" } }
                                }
                            }
                            @let r = &n.report;
                            td.node-sandboxes { (r.sandboxes) }
                            td { (gib(r.memory_promised_bytes)) " / " (gib(r.memory_promise_limit_bytes)) }
                            td { (gib(r.memory_available_bytes)) " / " (gib(r.memory_total_bytes)) }
                            td { (gib(r.disk_promised_bytes)) " / " (gib(r.disk_promise_limit_bytes)) }
                            td { (gib(r.disk_pool_free_bytes)) " / " (gib(r.disk_pool_bytes)) }
                            td { @if clustered {
                                (r.builds.running) " / " (r.builds.waiting) " / " (r.builds.slots)
                            } @else { "—" } }
                            td.node-templates { @match &n.templates {
                                Some(names) if names.is_empty() => { "none" }
                                Some(names) => { (names.join(", ")) }
                                None => { "—" }
                            } }
                        }
                    }
                }
            } }
            p.muted { "Memory and disk are each node's: every team's sandboxes share them. Only templates your team can use are named." }
        },
    )
}

fn ago_until(now: DateTime<Utc>, until: DateTime<Utc>) -> String {
    format!("{}s left", (until - now).num_seconds().max(0))
}
