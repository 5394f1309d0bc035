//! One `RUN` step of a build: its sandbox started, the command run within the step limit,
//! and the sandbox then kept as the step's layer or removed.

use std::time::Duration;

use sandbar_core::builds::{BuildFailure, step_timeout_message};

/// What a `RUN` step needs of the node, so the ways a step ends are tested without one.
#[async_trait::async_trait]
pub(crate) trait StepHost: Send + Sync {
    type Sandbox: Send + Sync;
    /// Why the step's sandbox does not start.
    type StartError: std::fmt::Display + Send;
    /// Why the command cannot be run to its end (not its exit code: that is the command's).
    type ExecError: std::fmt::Display + Send;
    /// Why the sandbox cannot be kept as the step's layer.
    type CommitError: std::fmt::Display + Send;
    /// Starts the step's sandbox.
    async fn start(&self) -> Result<Self::Sandbox, Self::StartError>;
    /// Runs the step's command in `sandbox` to its end, handing its output on; its exit
    /// code. (The output callback's lifetime is spelled out: `async_trait` would otherwise
    /// tie the bytes to the call.)
    async fn exec(
        &self,
        sandbox: &Self::Sandbox,
        on_output: &mut (dyn for<'b> FnMut(&'b [u8]) + Send),
    ) -> Result<i32, Self::ExecError>;
    /// Keeps the sandbox's writable layer as the step's layer; the sandbox is gone after.
    async fn commit(&self, sandbox: Self::Sandbox) -> Result<(), Self::CommitError>;
    /// Removes the sandbox with its processes and disk.
    async fn discard(&self, sandbox: Self::Sandbox);
}

/// Runs `command` as step `step` in a sandbox `host` starts; a command still running after
/// `limit` is ended with its sandbox and fails the step.
pub(crate) async fn run_step<H: StepHost>(
    host: &H,
    step: &str,
    command: &str,
    limit: Duration,
    on_output: &mut (dyn FnMut(&[u8]) + Send),
) -> Result<(), BuildFailure> {
    let sandbox = host
        .start()
        .await
        .map_err(|e| BuildFailure::at(step, format!("cannot start the build sandbox: {e}")))?;
    let outcome = tokio::time::timeout(limit, host.exec(&sandbox, on_output)).await;
    let message = match outcome {
        Ok(Ok(0)) => {
            return host
                .commit(sandbox)
                .await
                .map_err(|e| BuildFailure::at(step, e.to_string()));
        }
        Ok(Ok(code)) => format!("step {step} (RUN {command}) failed with exit code {code}"),
        Ok(Err(e)) => format!("step {step} (RUN {command}) could not run: {e}"),
        Err(_) => step_timeout_message(step, command, limit),
    };
    host.discard(sandbox).await;
    Err(BuildFailure::at(step, message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records what the step asked of it; its command prints a line and then exits with
    /// `exit`, or never ends when `exit` is `None`.
    struct FakeHost {
        exit: Option<i32>,
        calls: Mutex<Vec<&'static str>>,
    }

    impl FakeHost {
        fn new(exit: Option<i32>) -> Self {
            Self {
                exit,
                calls: Mutex::new(Vec::new()),
            }
        }

        fn record(&self, call: &'static str) {
            self.calls.lock().expect("calls").push(call);
        }

        fn calls(&self) -> Vec<&'static str> {
            self.calls.lock().expect("calls").clone()
        }
    }

    #[async_trait::async_trait]
    impl StepHost for FakeHost {
        type Sandbox = ();
        type StartError = std::convert::Infallible;
        type ExecError = std::convert::Infallible;
        type CommitError = std::convert::Infallible;

        async fn start(&self) -> Result<(), Self::StartError> {
            self.record("start");
            Ok(())
        }

        async fn exec(
            &self,
            _: &(),
            on_output: &mut (dyn for<'b> FnMut(&'b [u8]) + Send),
        ) -> Result<i32, Self::ExecError> {
            self.record("exec");
            on_output(b"working\n");
            match self.exit {
                Some(code) => Ok(code),
                None => std::future::pending().await,
            }
        }

        async fn commit(&self, _: ()) -> Result<(), Self::CommitError> {
            self.record("commit");
            Ok(())
        }

        async fn discard(&self, _: ()) {
            self.record("discard");
        }
    }

    async fn run(host: &FakeHost, limit: Duration) -> (Result<(), BuildFailure>, Vec<u8>) {
        let mut output = Vec::new();
        let result = run_step(host, "3", "sleep 100000", limit, &mut |bytes: &[u8]| {
            output.extend_from_slice(bytes)
        })
        .await;
        (result, output)
    }

    #[tokio::test]
    async fn a_step_past_its_limit_fails_the_build_and_its_sandbox_goes() {
        let host = FakeHost::new(None);
        let started = std::time::Instant::now();
        let (result, output) = run(&host, Duration::from_secs(1)).await;
        let failure = result.expect_err("the step outlived its limit");
        assert_eq!(
            failure.message,
            "step 3 (RUN sleep 100000) exceeded the 1 s step limit"
        );
        assert_eq!(failure.step.as_deref(), Some("3"));
        assert_eq!(host.calls(), ["start", "exec", "discard"]);
        assert_eq!(output, b"working\n", "output before the limit is kept");
        assert!(started.elapsed() >= Duration::from_secs(1));
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[tokio::test]
    async fn a_step_within_its_limit_is_kept_or_fails_on_its_exit_code() {
        let host = FakeHost::new(Some(0));
        let (result, _) = run(&host, Duration::from_secs(60)).await;
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(host.calls(), ["start", "exec", "commit"]);

        let host = FakeHost::new(Some(2));
        let (result, _) = run(&host, Duration::from_secs(60)).await;
        assert_eq!(
            result.expect_err("exit code 2").message,
            "step 3 (RUN sleep 100000) failed with exit code 2"
        );
        assert_eq!(host.calls(), ["start", "exec", "discard"]);
    }
}
