//! `sandbar-bench layers`: one template layer through a cluster's layer store, as a node
//! publishes it after a build (archive, push) and as another node fetches it before a create
//! (download with digest check, unpack). Each iteration pushes to a repository of its own,
//! so every push uploads the whole archive.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use sandbar_image::{BlobStore, RegistryPolicy};

use crate::stats::summarize;

#[derive(clap::Args, Debug)]
pub struct LayersArgs {
    /// The layer store's registry, `http://host:port` (each iteration uses a repository of
    /// its own below it).
    #[arg(long)]
    registry: String,
    /// The layer directory to send, e.g. `<data>/templates/base-v2/rootfs`.
    #[arg(long)]
    layer: PathBuf,
    #[arg(long, default_value_t = 3)]
    iterations: usize,
    /// Where archives and unpacked copies go [default: the temporary directory].
    #[arg(long)]
    tmp_dir: Option<PathBuf>,
}

#[derive(Default)]
struct Samples {
    archive: Vec<Duration>,
    push: Vec<Duration>,
    fetch: Vec<Duration>,
    unpack: Vec<Duration>,
}

pub async fn main(args: LayersArgs) -> ExitCode {
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: LayersArgs) -> anyhow::Result<()> {
    let url = url_host(&args.registry)?;
    let policy = Arc::new(RegistryPolicy::new(vec![url.parse()?], vec![], vec![])?);
    let tmp = match &args.tmp_dir {
        Some(dir) => tempfile::tempdir_in(dir)?,
        None => tempfile::tempdir()?,
    };
    let mut samples = Samples::default();
    let mut bytes = 0;
    for i in 0..args.iterations {
        let store = BlobStore::new(
            &format!(
                "{}/bench/layers-{}-{i}",
                args.registry.trim_end_matches('/'),
                std::process::id()
            ),
            None,
            policy.clone(),
        )?;
        let archive = tmp.path().join(format!("layer-{i}.tar"));
        let t = Instant::now();
        let archived = {
            let (layer, archive) = (args.layer.clone(), archive.clone());
            tokio::task::spawn_blocking(move || {
                let file = std::fs::File::create_new(&archive)?;
                sandbar_node::storage::layer_archive::write_layer(&layer, file)
            })
            .await??
        };
        samples.archive.push(t.elapsed());
        bytes = archived.size;
        let t = Instant::now();
        store.push_file(&archive, &archived.digest).await?;
        samples.push.push(t.elapsed());
        std::fs::remove_file(&archive)?;

        let fetched = tmp.path().join(format!("fetched-{i}.tar"));
        let t = Instant::now();
        store
            .fetch_to(&archived.digest, archived.size, &fetched)
            .await?;
        samples.fetch.push(t.elapsed());
        let dest = tmp.path().join(format!("unpacked-{i}"));
        std::fs::create_dir(&dest)?;
        let t = Instant::now();
        {
            let (fetched, dest) = (fetched.clone(), dest.clone());
            tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                let file = std::fs::File::open(&fetched)?;
                sandbar_image::apply_layer(
                    std::io::BufReader::with_capacity(1 << 20, file),
                    &dest,
                )?;
                // What a node does before it uses the layer: on disk, not only in the cache.
                let dir = std::fs::File::open(&dest)?;
                rustix::fs::syncfs(&dir)?;
                Ok(())
            })
            .await??;
        }
        samples.unpack.push(t.elapsed());
        std::fs::remove_file(&fetched)?;
        std::fs::remove_dir_all(&dest).with_context(|| format!("remove {}", dest.display()))?;
        eprintln!("iteration {}/{}", i + 1, args.iterations);
    }
    println!(
        "layer {} ({:.1} MiB archived), {} iterations",
        args.layer.display(),
        bytes as f64 / f64::from(1u32 << 20),
        args.iterations
    );
    let mib = bytes as f64 / f64::from(1u32 << 20);
    for (name, series) in [
        ("archive", &samples.archive),
        ("push", &samples.push),
        ("fetch", &samples.fetch),
        ("unpack+syncfs", &samples.unpack),
    ] {
        if let Some(s) = summarize(series) {
            println!(
                "  {name:>14}: p50 {:>7.0} ms  min {:>7.0} ms  max {:>7.0} ms  ({:.0} MiB/s at p50)",
                s.p50,
                s.min,
                s.max,
                mib / (s.p50 / 1000.0)
            );
        }
    }
    let publish = paired_sums(&samples.archive, &samples.push);
    let fetch = paired_sums(&samples.fetch, &samples.unpack);
    for (name, series) in [("publish", &publish), ("fetch+unpack", &fetch)] {
        if let Some(s) = summarize(series) {
            println!("  {name:>14}: p50 {:>7.0} ms", s.p50);
        }
    }
    Ok(())
}

/// The time of each round's two steps together: `first` and `then` hold one sample a round.
fn paired_sums(first: &[Duration], then: &[Duration]) -> Vec<Duration> {
    first.iter().zip(then).map(|(a, b)| *a + *b).collect()
}

/// `host:port` of an `http[s]://host:port` address.
fn url_host(registry: &str) -> anyhow::Result<String> {
    let rest = registry
        .strip_prefix("http://")
        .or_else(|| registry.strip_prefix("https://"))
        .context("--registry must start with http:// or https://")?;
    Ok(rest.trim_end_matches('/').to_owned())
}
