//! The built-in `desktop` template, the one E2B's Desktop SDKs (`e2b-desktop`,
//! `@e2b/desktop`) create by default: an X server (Xvfb), a light Xfce session, xdotool and
//! scrot for the SDKs' mouse, keyboard and screenshots, x11vnc with noVNC and websockify at
//! `/opt/noVNC` for their stream, Firefox, a terminal and a text editor.
//!
//! Built like the code interpreter template: a Debian root made with mmdebstrap
//! ([`DESKTOP_ROOT`]), the node's own scripts placed by `COPY` steps, and a start command
//! that brings up the X server and the session. The builder captures the started sandbox with
//! its memory, so a create restores a desktop that is already drawn. The SDKs still start
//! `Xvfb` and `startxfce4` after each create; the template's wrappers of both keep the running
//! ones when they match what is asked for (see `desktop/Xvfb`), and start the asked-for ones
//! otherwise (another screen size, DPI or display). A wrapper of `xdpyinfo`, which the SDKs
//! check the display with, waits while such a replacement is deciding.

use std::path::Path;

use sandbar_core::builds::{BuildSource, BuildSpec};

use crate::build::builtin_files::{self, StageError, StagedFile, copy};
use crate::build::templates::RootRecipe;

/// Its root's layer name; always `desktop/v{DESKTOP_ROOT.version}`.
pub const DESKTOP_LAYER: &str = "desktop/v1";
/// The noVNC port the SDKs' stream listens on inside the sandbox.
pub const STREAM_PORT: u16 = 6080;

const START_NAME: &str = "start-session";
const START_PATH: &str = "/opt/sandbar/desktop/";
const START_SCRIPT: &str = include_str!("desktop/start-session.sh");
const XVFB_WRAPPER: &str = include_str!("desktop/Xvfb");
const XFCE_WRAPPER: &str = include_str!("desktop/startxfce4");
const XDPYINFO_WRAPPER: &str = include_str!("desktop/xdpyinfo");
/// Ahead of `/usr/bin` on every user's `PATH`.
const WRAPPERS_DIR: &str = "/usr/local/bin/";

/// The template's root: the default template's packages, the X server and the tools the
/// SDKs run (`xdpyinfo`, `xrandr`, `xdotool`, `scrot`, `x11vnc`, `netstat`, `xdg-open`,
/// `gtk-launch`), the parts of Xfce a session needs (no display manager, power manager or
/// screen locker: nothing here logs in or sleeps), noVNC where the SDKs look for it, and a
/// browser, terminal and editor to drive. Recommends are not installed (mmdebstrap's
/// default), which keeps the root at about 1.1 GB.
///
/// The panel's first start would ask, in a dialog on the screen, which layout to use; the
/// user gets Debian's default layout beforehand. Documentation, manual pages and translations
/// other than English are removed: nothing in a sandbox reads them.
pub const DESKTOP_ROOT: RootRecipe = RootRecipe {
    name: "desktop",
    version: 1,
    packages: "bash,python3,ca-certificates,sudo,procps,curl,git,iproute2,coreutils,\
               xvfb,x11-utils,x11-xserver-utils,xdotool,scrot,imagemagick,x11vnc,novnc,\
               websockify,python3-numpy,net-tools,xdg-utils,libgtk-3-bin,dbus-x11,\
               xfce4-session,xfwm4,xfdesktop4,xfce4-panel,xfce4-settings,xfconf,thunar,\
               xfce4-terminal,mousepad,firefox-esr,fonts-dejavu-core",
    hooks: &[
        "--customize-hook=ln -s /usr/share/novnc \"$1/opt/noVNC\"",
        // The session manager listens on an abstract socket and, where it can, on one in
        // this directory; a socket bound to a path cannot be restored from the capture, so
        // the user cannot bind one here.
        "--customize-hook=install -d -m 0755 -o root -g root \"$1/tmp/.ICE-unix\"",
        "--customize-hook=chroot \"$1\" su user -c 'mkdir -p ~/.config/xfce4/xfconf/xfce-perchannel-xml \
         && cp /etc/xdg/xfce4/panel/default.xml ~/.config/xfce4/xfconf/xfce-perchannel-xml/xfce4-panel.xml'",
        "--customize-hook=rm -rf \"$1/usr/share/doc\"/* \"$1/usr/share/man\"/* \
         && find \"$1/usr/share/locale\" -mindepth 1 -maxdepth 1 ! -name 'en*' \
         ! -name locale.alias -exec rm -rf {} +",
    ],
};

/// Stages the files the recipe copies (the start command and the three wrappers) in the
/// built-in upload namespace under `uploads_dir` and returns the upload's hash.
pub fn stage_files(uploads_dir: &Path) -> Result<String, StageError> {
    builtin_files::stage(
        uploads_dir,
        &[
            StagedFile::new(START_NAME, 0o755, START_SCRIPT.as_bytes()),
            StagedFile::new("Xvfb", 0o755, XVFB_WRAPPER.as_bytes()),
            StagedFile::new("startxfce4", 0o755, XFCE_WRAPPER.as_bytes()),
            StagedFile::new("xdpyinfo", 0o755, XDPYINFO_WRAPPER.as_bytes()),
        ],
    )
}

/// The template's recipe; `files_hash` names the staged files (see [`stage_files`]).
pub fn build_spec(files_hash: &str) -> BuildSpec {
    BuildSpec {
        source: BuildSource::Builtin {
            layer: DESKTOP_LAYER.into(),
        },
        steps: vec![
            copy(START_NAME, START_PATH, "root", files_hash),
            copy("Xvfb", WRAPPERS_DIR, "root", files_hash),
            copy("startxfce4", WRAPPERS_DIR, "root", files_hash),
            copy("xdpyinfo", WRAPPERS_DIR, "root", files_hash),
        ],
        force: false,
        start_cmd: Some(format!("{START_PATH}{START_NAME}")),
        // The SDKs drive the desktop as the default user; its X server and session are that
        // user's too.
        start_user: Some("user".into()),
        // Ready once the session's window manager, desktop and panel are all up (what the
        // SDKs wait for after their own `startxfce4`), the panel is on the screen and the
        // desktop has drawn its background. The panel paints its buttons a moment after it
        // is mapped, and the capture must hold a finished screen: the first screenshot of a
        // new sandbox is of what was captured.
        ready_cmd: Some(
            "pgrep -x xfce4-session && pgrep -x xfwm4 && pgrep -x xfdesktop \
             && DISPLAY=:0 xdotool search --onlyvisible --class xfce4-panel \
             && DISPLAY=:0 xprop -root _XROOTPMAP_ID | grep -q 'pixmap id' && sleep 2"
                .into(),
        ),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_root_has_every_package_the_sdks_run() {
        assert_eq!(DESKTOP_LAYER, DESKTOP_ROOT.layer());
        // Every tool the SDKs run has its package.
        for package in [
            "xvfb",
            "x11-utils",
            "xdotool",
            "scrot",
            "x11vnc",
            "novnc",
            "net-tools",
        ] {
            assert!(
                DESKTOP_ROOT
                    .packages
                    .split(',')
                    .any(|p| p.trim() == package),
                "{package}"
            );
        }
    }

    #[test]
    fn the_wrappers_keep_a_matching_session_and_hand_over_otherwise() {
        assert!(XVFB_WRAPPER.contains("exec /usr/bin/Xvfb \"$@\""));
        assert!(XFCE_WRAPPER.contains("exec /usr/bin/startxfce4 \"$@\""));
        assert!(START_SCRIPT.contains("1024x768x24"));
        let spec = build_spec(&"a".repeat(64));
        assert_eq!(
            spec.start_cmd.as_deref(),
            Some("/opt/sandbar/desktop/start-session")
        );
        assert!(spec.ready_cmd.unwrap().contains("xfdesktop"));
    }

    /// Runs the `Xvfb` wrapper with a fake `xdpyinfo` describing the running server and a
    /// `pkill` that only records; returns the exit status and what was killed.
    fn run_xvfb_wrapper(running: &str, args: &[&str]) -> (i32, String) {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path();
        let killed = bin.join("killed");
        let script = |name: &str, body: String| {
            let path = bin.join(name);
            std::fs::write(&path, body).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        script(
            "xdpyinfo",
            format!("#!/bin/sh\nprintf '%s\\n' '{running}'\n"),
        );
        script(
            "pkill",
            format!("#!/bin/sh\necho \"$*\" >> {}\n", killed.display()),
        );
        // The server and session it is asked to stop never go away here.
        script("pgrep", "#!/bin/sh\nexit 0\n".into());
        let wrapper = bin.join("Xvfb");
        let fake = bin.join("xdpyinfo").display().to_string();
        std::fs::write(&wrapper, XVFB_WRAPPER.replace("/usr/bin/xdpyinfo", &fake)).unwrap();
        let status = std::process::Command::new("sh")
            .arg(&wrapper)
            .args(args)
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
            .status()
            .unwrap();
        let killed = std::fs::read_to_string(&killed).unwrap_or_default();
        (status.code().unwrap_or(-1), killed)
    }

    /// What the SDKs run after each create, at their default size and DPI.
    const SDK_ARGS: [&str; 12] = [
        ":0",
        "-ac",
        "-screen",
        "0",
        "1024x768x24",
        "-retro",
        "-dpi",
        "96",
        "-nolisten",
        "tcp",
        "-nolisten",
        "unix",
    ];

    /// The lines of `xdpyinfo` the wrapper reads, for a 24-bit screen of `size` at 96 DPI.
    fn xdpyinfo_of(size: &str) -> String {
        format!(
            "  dimensions:    {size} pixels (271x203 millimeters)\n  \
             resolution:    96x96 dots per inch\n  depth of root window:    24 planes"
        )
    }

    #[test]
    fn the_xvfb_wrapper_keeps_a_server_of_the_asked_geometry() {
        let (status, killed) = run_xvfb_wrapper(&xdpyinfo_of("1024x768"), &SDK_ARGS);
        assert_eq!(status, 0);
        assert_eq!(killed, "", "nothing is stopped");
    }

    #[test]
    fn the_xvfb_wrapper_stops_a_server_of_another_geometry() {
        // The fake server never goes away, so the wrapper gives up after its bounded wait,
        // having asked both the session and the server to end, then by force.
        let (status, killed) = run_xvfb_wrapper(&xdpyinfo_of("800x600"), &SDK_ARGS);
        assert_eq!(status, 1);
        assert!(killed.starts_with("-u "), "the server goes first: {killed}");
        assert!(killed.contains("xfce4-session"), "{killed}");
        assert!(killed.contains("-f ^/usr/bin/Xvfb :0( |$)"), "{killed}");
        assert!(killed.contains("-KILL"), "{killed}");
    }
}
