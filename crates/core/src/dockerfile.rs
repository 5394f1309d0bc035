//! Dockerfiles as build steps: the seed's `POST /templates` flow hands a Dockerfile that is
//! parsed here and mapped onto the same steps the SDKs send, so one executor builds both.

use std::collections::BTreeMap;

use parse_dockerfile::{
    AddInstruction, ArgInstruction, Command, EnvInstruction, FromInstruction, Instruction,
    RunInstruction, Source,
};

use crate::model::builds::{BuildSource, BuildSpec, BuildStep, StepKind};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DockerfileError {
    #[error("invalid Dockerfile: {0}")]
    Syntax(String),
    #[error("line {line}: {instruction} is not supported: {reason}")]
    Unsupported {
        line: usize,
        instruction: &'static str,
        reason: String,
    },
    #[error("line {line}: {instruction}: {reason}")]
    Invalid {
        line: usize,
        instruction: &'static str,
        reason: String,
    },
    #[error("the Dockerfile has no FROM instruction")]
    NoFrom,
}

/// A Dockerfile mapped onto build steps. `COPY`/`ADD` steps name `context_hash`, the upload
/// holding the build context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DockerfileBuild {
    pub spec: BuildSpec,
    /// Whether any step reads the build context.
    pub uses_context: bool,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// `$NAME` and `${NAME}` (with `${NAME:-default}`) from `args`; unknown names become empty,
/// as in Docker.
fn substitute(value: &str, args: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(value.len());
    let mut chars = value.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' && chars.peek() == Some(&'$') {
            out.push('$');
            chars.next();
            continue;
        }
        if c != '$' {
            out.push(c);
            continue;
        }
        if chars.peek() == Some(&'{') {
            chars.next();
            let mut inner = String::new();
            for c in chars.by_ref() {
                if c == '}' {
                    break;
                }
                inner.push(c);
            }
            let (name, default) = match inner.split_once(":-") {
                Some((n, d)) => (n.to_owned(), Some(d.to_owned())),
                None => (inner, None),
            };
            match args.get(&name).filter(|v| !v.is_empty()) {
                Some(v) => out.push_str(v),
                None => out.push_str(&default.unwrap_or_default()),
            }
        } else {
            let mut name = String::new();
            while let Some(&c) = chars.peek() {
                if c.is_ascii_alphanumeric() || c == '_' {
                    name.push(c);
                    chars.next();
                } else {
                    break;
                }
            }
            if name.is_empty() {
                out.push('$');
            } else {
                out.push_str(args.get(&name).map(String::as_str).unwrap_or(""));
            }
        }
    }
    out
}

/// Why the pairs of an `ARG` or `ENV` cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum KeyValuesError {
    #[error("'{name}' has no value")]
    NoValue { name: String },
    #[error("unterminated quote in '{name}'")]
    Unterminated { name: String },
}

/// Splits `a=1 b="two words"` (or the legacy `NAME value`) into pairs.
fn key_values(raw: &str) -> Result<Vec<(String, String)>, KeyValuesError> {
    let raw = raw.trim();
    let first = raw.split_whitespace().next().unwrap_or("");
    if !first.contains('=') {
        let (name, value) =
            raw.split_once(char::is_whitespace)
                .ok_or_else(|| KeyValuesError::NoValue {
                    name: raw.to_owned(),
                })?;
        return Ok(vec![(name.to_owned(), value.trim().to_owned())]);
    }
    let mut pairs = Vec::new();
    let mut chars = raw.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut name = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' {
                break;
            }
            name.push(c);
            chars.next();
        }
        if chars.next() != Some('=') {
            return Err(KeyValuesError::NoValue { name });
        }
        let mut value = String::new();
        let mut quote: Option<char> = None;
        while let Some(&c) = chars.peek() {
            match quote {
                None if c.is_whitespace() => break,
                None if c == '"' || c == '\'' => quote = Some(c),
                Some(q) if c == q => quote = None,
                _ if c == '\\' => {
                    chars.next();
                    if let Some(&n) = chars.peek() {
                        value.push(n);
                    }
                }
                _ => value.push(c),
            }
            chars.next();
        }
        if quote.is_some() {
            return Err(KeyValuesError::Unterminated { name });
        }
        pairs.push((name, value));
    }
    Ok(pairs)
}

fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-_./=:@%+,".contains(&c))
    {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn command_text(command: &Command<'_>) -> String {
    match command {
        Command::Exec(words) => words
            .value
            .iter()
            .map(|w| shell_quote(&w.value))
            .collect::<Vec<_>>()
            .join(" "),
        Command::Shell(text) => text.value.replace("\\\n", " ").trim().to_owned(),
        _ => String::new(),
    }
}

/// Maps `dockerfile` onto a build. `context_hash` names the uploaded build context that
/// `COPY`/`ADD` read from.
pub fn to_build(
    dockerfile: &str,
    context_hash: Option<&str>,
) -> Result<DockerfileBuild, DockerfileError> {
    let parsed =
        parse_dockerfile::parse(dockerfile).map_err(|e| DockerfileError::Syntax(e.to_string()))?;
    let mut mapping = Mapping::new(dockerfile, context_hash);
    for instruction in &parsed.instructions {
        mapping.read(instruction)?;
    }
    mapping.finish()
}

/// What the instructions read so far amount to: each instruction family has a method that
/// adds its part, so an instruction's rules live in one place.
struct Mapping<'a> {
    dockerfile: &'a str,
    context_hash: Option<&'a str>,
    args: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    /// The `FROM` image; `None` until the first `FROM`.
    source: Option<String>,
    steps: Vec<StepKind>,
    start_cmd: Option<String>,
    entrypoint: Option<String>,
    uses_context: bool,
}

impl<'a> Mapping<'a> {
    fn new(dockerfile: &'a str, context_hash: Option<&'a str>) -> Self {
        Self {
            dockerfile,
            context_hash,
            args: BTreeMap::new(),
            env: BTreeMap::new(),
            source: None,
            steps: Vec::new(),
            start_cmd: None,
            entrypoint: None,
            uses_context: false,
        }
    }

    fn line(&self, offset: usize) -> usize {
        line_of(self.dockerfile, offset)
    }

    /// The names a value may refer to: build args, overridden by `ENV`.
    fn scope(&self) -> BTreeMap<String, String> {
        let mut all = self.args.clone();
        all.extend(self.env.clone());
        all
    }

    /// Adds one instruction. Only `ARG` may come before the `FROM`, as in Docker.
    fn read(&mut self, instruction: &Instruction<'_>) -> Result<(), DockerfileError> {
        match instruction {
            Instruction::From(from) => self.read_from(from),
            Instruction::Arg(arg) => self.read_arg(arg),
            _ if self.source.is_none() => Err(DockerfileError::NoFrom),
            Instruction::Run(run) => self.read_run(run),
            Instruction::Copy(copy) => {
                let line = self.line(copy.copy.span.start);
                self.read_copy(line, "COPY", &copy.options, &copy.src, &copy.dest.value)
            }
            Instruction::Add(add) => self.read_add(add),
            Instruction::Env(e) => self.read_env(e),
            Instruction::Workdir(w) => {
                let path = substitute(&w.arguments.value, &self.scope());
                self.steps.push(StepKind::Workdir { path });
                Ok(())
            }
            Instruction::User(u) => {
                let user = substitute(&u.arguments.value, &self.scope());
                self.steps.push(StepKind::User { user });
                Ok(())
            }
            Instruction::Cmd(cmd) => {
                self.start_cmd = Some(command_text(&cmd.arguments));
                Ok(())
            }
            Instruction::Entrypoint(e) => {
                self.entrypoint = Some(command_text(&e.arguments));
                Ok(())
            }
            // Metadata for image registries; a sandbox has no use for it.
            Instruction::Label(_) | Instruction::Maintainer(_) | Instruction::Expose(_) => Ok(()),
            other => Err(self.unsupported(other)),
        }
    }

    /// `FROM`: one stage, from a real image.
    fn read_from(&mut self, from: &FromInstruction<'_>) -> Result<(), DockerfileError> {
        let line = self.line(from.from.span.start);
        if self.source.is_some() {
            return Err(DockerfileError::Unsupported {
                line,
                instruction: "FROM",
                reason: "multi-stage builds (a second FROM)".into(),
            });
        }
        if let Some(flag) = from.options.first() {
            return Err(DockerfileError::Unsupported {
                line,
                instruction: "FROM",
                reason: format!("the option --{}", flag.name.value),
            });
        }
        let image = substitute(&from.image.value, &self.args);
        if image == "scratch" {
            return Err(DockerfileError::Unsupported {
                line,
                instruction: "FROM",
                reason: "FROM scratch (a template needs a base image)".into(),
            });
        }
        self.source = Some(image);
        Ok(())
    }

    /// `ARG`: the first definition of a name wins, as in Docker.
    fn read_arg(&mut self, arg: &ArgInstruction<'_>) -> Result<(), DockerfileError> {
        let line = self.line(arg.arg.span.start);
        let raw = arg.arguments.value.trim();
        let (name, value) = match raw.split_once('=') {
            Some((n, v)) => {
                let pairs = key_values(raw).map_err(|e| DockerfileError::Invalid {
                    line,
                    instruction: "ARG",
                    reason: e.to_string(),
                })?;
                let v = pairs
                    .into_iter()
                    .next()
                    .map(|(_, v)| v)
                    .unwrap_or_else(|| v.to_owned());
                (n.to_owned(), v)
            }
            None => (raw.to_owned(), String::new()),
        };
        let value = substitute(&value, &self.args);
        self.args.entry(name).or_insert(value);
        Ok(())
    }

    /// `RUN`: a shell command, or one here-document run as a script.
    fn read_run(&mut self, run: &RunInstruction<'_>) -> Result<(), DockerfileError> {
        let line = self.line(run.run.span.start);
        if let Some(flag) = run.options.first() {
            return Err(DockerfileError::Unsupported {
                line,
                instruction: "RUN",
                reason: format!("the option --{}", flag.name.value),
            });
        }
        let command = match run.here_docs.as_slice() {
            [] => command_text(&run.arguments),
            [doc] => doc.value.to_string(),
            _ => {
                return Err(DockerfileError::Unsupported {
                    line,
                    instruction: "RUN",
                    reason: "more than one here-document".into(),
                });
            }
        };
        // Build args are visible to RUN as environment, as in Docker.
        let prefix: Vec<String> = self
            .args
            .iter()
            .filter(|(k, _)| !self.env.contains_key(*k))
            .map(|(k, v)| format!("{k}={}", shell_quote(v)))
            .collect();
        let command = if prefix.is_empty() {
            command
        } else {
            format!("export {}; {command}", prefix.join(" "))
        };
        self.steps.push(StepKind::Run {
            command,
            user: None,
        });
        Ok(())
    }

    /// `COPY` and `ADD`: one source from the build context.
    fn read_copy(
        &mut self,
        line: usize,
        instruction: &'static str,
        options: &[parse_dockerfile::Flag<'_>],
        sources: &[Source<'_>],
        dest: &str,
    ) -> Result<(), DockerfileError> {
        let step = copy_step(
            line,
            instruction,
            options,
            sources,
            dest,
            self.context_hash,
            &self.scope(),
        )?;
        self.steps.push(step);
        self.uses_context = true;
        Ok(())
    }

    /// `ADD`: as `COPY`, without the URLs and archive extraction Docker's has.
    fn read_add(&mut self, add: &AddInstruction<'_>) -> Result<(), DockerfileError> {
        let line = self.line(add.add.span.start);
        for src in &add.src {
            if let Source::Path(p) = src
                && (p.value.contains("://") || is_archive(&p.value))
            {
                return Err(DockerfileError::Unsupported {
                    line,
                    instruction: "ADD",
                    reason: format!(
                        "'{}': URLs and archive extraction (use RUN curl / tar)",
                        p.value
                    ),
                });
            }
        }
        self.read_copy(line, "ADD", &add.options, &add.src, &add.dest.value)
    }

    /// `ENV`: seen by later instructions' values and by the build's steps.
    fn read_env(&mut self, e: &EnvInstruction<'_>) -> Result<(), DockerfileError> {
        let line = self.line(e.env.span.start);
        let pairs = key_values(&e.arguments.value).map_err(|e| DockerfileError::Invalid {
            line,
            instruction: "ENV",
            reason: e.to_string(),
        })?;
        let mut vars = Vec::new();
        crate::inputs::check_env_names(pairs.iter().map(|(k, _)| k)).map_err(|e| {
            DockerfileError::Invalid {
                line,
                instruction: "ENV",
                reason: e.to_string(),
            }
        })?;
        for (k, v) in pairs {
            let v = substitute(&v, &self.scope());
            self.env.insert(k.clone(), v.clone());
            vars.push((k, v));
        }
        self.steps.push(StepKind::Env { vars });
        Ok(())
    }

    /// The error for an instruction templates have no use for, naming its line.
    fn unsupported(&self, other: &Instruction<'_>) -> DockerfileError {
        let (keyword, start) = match other {
            Instruction::Healthcheck(i) => ("HEALTHCHECK", i.healthcheck.span.start),
            Instruction::Onbuild(i) => ("ONBUILD", i.onbuild.span.start),
            Instruction::Shell(i) => ("SHELL", i.shell.span.start),
            Instruction::Stopsignal(i) => ("STOPSIGNAL", i.stopsignal.span.start),
            Instruction::Volume(i) => ("VOLUME", i.volume.span.start),
            _ => ("this instruction", 0),
        };
        DockerfileError::Unsupported {
            line: self.line(start),
            instruction: keyword,
            reason: "templates support FROM, ARG, RUN, COPY, ADD, ENV, WORKDIR, USER, CMD, ENTRYPOINT, LABEL, EXPOSE".into(),
        }
    }

    /// The build the instructions amount to.
    fn finish(self) -> Result<DockerfileBuild, DockerfileError> {
        let image = self.source.ok_or(DockerfileError::NoFrom)?;
        let start_cmd = match (self.entrypoint, self.start_cmd) {
            (Some(e), Some(c)) => Some(format!("{e} {c}")),
            (e, c) => e.or(c),
        };
        Ok(DockerfileBuild {
            spec: BuildSpec {
                source: BuildSource::Image {
                    reference: image,
                    credentials: None,
                },
                steps: framed_steps(self.steps)
                    .into_iter()
                    .map(|kind| BuildStep { kind, force: false })
                    .collect(),
                force: false,
                start_cmd,
                start_user: None,
                ready_cmd: None,
            },
            uses_context: self.uses_context,
        })
    }
}

/// Docker runs a Dockerfile as root from `/`; the template then leaves sandboxes with the
/// Dockerfile's last USER and WORKDIR, or E2B's `user` in its home.
fn framed_steps(steps: Vec<StepKind>) -> Vec<StepKind> {
    let last_user = steps.iter().rev().find_map(|s| match s {
        StepKind::User { user } => Some(user.clone()),
        _ => None,
    });
    let last_workdir = steps.iter().rev().find_map(|s| match s {
        StepKind::Workdir { path } => Some(path.clone()),
        _ => None,
    });
    let mut steps: Vec<StepKind> = [
        StepKind::User {
            user: "root".into(),
        },
        StepKind::Workdir { path: "/".into() },
    ]
    .into_iter()
    .chain(steps)
    .collect();
    let final_user = last_user.unwrap_or_else(|| "user".into());
    steps.push(StepKind::Workdir {
        path: last_workdir.unwrap_or_else(|| format!("/home/{final_user}")),
    });
    steps.push(StepKind::User { user: final_user });
    steps
}

fn is_archive(path: &str) -> bool {
    [".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst"]
        .iter()
        .any(|ext| path.ends_with(ext))
}

fn copy_step(
    line: usize,
    instruction: &'static str,
    options: &[parse_dockerfile::Flag<'_>],
    sources: &[Source<'_>],
    dest: &str,
    context_hash: Option<&str>,
    scope: &BTreeMap<String, String>,
) -> Result<StepKind, DockerfileError> {
    let mut owner = None;
    let mut mode = None;
    for flag in options {
        let value = flag.value.as_ref().map(|v| v.value.to_string());
        match (&*flag.name.value, value) {
            ("chown", Some(v)) => owner = Some(substitute(&v, scope)),
            ("chmod", Some(v)) => {
                mode = Some(
                    u32::from_str_radix(&v, 8).map_err(|_| DockerfileError::Invalid {
                        line,
                        instruction,
                        reason: format!("--chmod={v} is not an octal mode"),
                    })?,
                )
            }
            (name, _) => {
                return Err(DockerfileError::Unsupported {
                    line,
                    instruction,
                    reason: format!("the option --{name}"),
                });
            }
        }
    }
    let hash = context_hash.ok_or_else(|| DockerfileError::Invalid {
        line,
        instruction,
        reason: "no build context was uploaded for this build".into(),
    })?;
    let [Source::Path(src)] = sources else {
        return Err(DockerfileError::Unsupported {
            line,
            instruction,
            reason: "several sources or here-documents in one instruction (use one per line)"
                .into(),
        });
    };
    Ok(StepKind::Copy {
        src: substitute(&src.value, scope),
        dest: substitute(dest, scope),
        owner,
        mode,
        files_hash: hash.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn kinds(build: &DockerfileBuild) -> Vec<StepKind> {
        build.spec.steps.iter().map(|s| s.kind.clone()).collect()
    }

    #[test]
    fn a_dockerfile_becomes_steps() {
        let text = "ARG VERSION=3\nFROM python:${VERSION}-slim\nENV A=1 B=\"two words\"\nRUN pip install \\\n  requests\nCOPY --chown=user:user --chmod=755 app.py /app/\nWORKDIR /app\nUSER user\nLABEL x=y\nCMD [\"python\", \"app.py\"]\n";
        let build = to_build(text, Some(HASH)).expect("maps");
        assert_eq!(
            build.spec.source,
            BuildSource::Image {
                reference: "python:3-slim".into(),
                credentials: None
            }
        );
        let steps = kinds(&build);
        assert_eq!(
            steps[0],
            StepKind::User {
                user: "root".into()
            }
        );
        assert_eq!(steps[1], StepKind::Workdir { path: "/".into() });
        let last = &steps[steps.len() - 2..];
        assert_eq!(
            last,
            [
                StepKind::Workdir {
                    path: "/app".into()
                },
                StepKind::User {
                    user: "user".into()
                }
            ]
        );
        let steps = &steps[2..];
        assert_eq!(
            steps[0],
            StepKind::Env {
                vars: vec![("A".into(), "1".into()), ("B".into(), "two words".into())]
            }
        );
        assert_eq!(
            steps[1],
            StepKind::Run {
                command: "export VERSION=3; pip install    requests".into(),
                user: None
            }
        );
        assert_eq!(
            steps[2],
            StepKind::Copy {
                src: "app.py".into(),
                dest: "/app/".into(),
                owner: Some("user:user".into()),
                mode: Some(0o755),
                files_hash: HASH.into()
            }
        );
        assert_eq!(build.spec.start_cmd.as_deref(), Some("python app.py"));
        assert!(build.uses_context);
    }

    #[test]
    fn here_documents_run_as_scripts() {
        let build =
            to_build("FROM alpine\nRUN <<EOF\necho one\necho two\nEOF\n", None).expect("maps");
        assert_eq!(
            kinds(&build)[2],
            StepKind::Run {
                command: "echo one\necho two\n".into(),
                user: None
            }
        );
    }

    #[test]
    fn unsupported_instructions_name_their_line() {
        for (dockerfile, context, refusal) in [
            (
                "FROM alpine\nRUN true\nHEALTHCHECK CMD true\n",
                None,
                ("unsupported", 3, "HEALTHCHECK"),
            ),
            (
                "FROM alpine AS a\nFROM a\n",
                None,
                ("unsupported", 2, "FROM"),
            ),
            (
                "FROM alpine\nADD https://example.invalid/x /x\n",
                Some(HASH),
                ("unsupported", 2, "ADD"),
            ),
            ("FROM alpine\nCOPY a /a\n", None, ("invalid", 2, "COPY")),
        ] {
            let err = to_build(dockerfile, context).expect_err("refused");
            let named = match &err {
                DockerfileError::Unsupported {
                    line, instruction, ..
                } => ("unsupported", *line, *instruction),
                DockerfileError::Invalid {
                    line, instruction, ..
                } => ("invalid", *line, *instruction),
                _ => panic!("{dockerfile:?}: {err}"),
            };
            assert_eq!(named, refusal, "{err}");
        }
        assert!(
            matches!(to_build("RUN true\n", None), Err(DockerfileError::Syntax(m)) if m.contains("line 1"))
        );
        assert!(matches!(
            to_build("FROM alpine\nFROBNICATE x\n", None),
            Err(DockerfileError::Syntax(_))
        ));
        assert!(matches!(
            to_build("FROM scratch\n", None),
            Err(DockerfileError::Unsupported { line: 1, .. })
        ));
    }

    #[test]
    fn substitution_follows_docker() {
        let args = BTreeMap::from([("A".to_owned(), "x".to_owned())]);
        assert_eq!(substitute("$A-${A}-${B:-d}-$B-\\$A", &args), "x-x-d--$A");
    }
}
