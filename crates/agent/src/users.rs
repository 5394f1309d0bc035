//! Linux users and groups, read straight from `/etc/passwd` and `/etc/group`.
//!
//! The agent is linked statically, so glibc's NSS lookups are not available; the sandbox's
//! account files are the only source of truth.

use std::path::{Path, PathBuf};

/// A user account as the agent needs it to start processes and own files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    /// Numeric user id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Home directory; relative paths resolve against it.
    pub home: PathBuf,
    /// Login shell, exported as `SHELL`.
    pub shell: String,
}

/// A group entry with its explicit members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Group name.
    pub name: String,
    /// Numeric group id.
    pub gid: u32,
    /// Members listed in the fourth field.
    pub members: Vec<String>,
}

/// Errors resolving users.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// The named user has no `/etc/passwd` entry.
    #[error("user '{0}' does not exist")]
    UnknownUser(String),
    /// The account file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Snapshot of the account database.
#[derive(Debug, Clone, Default)]
pub struct Accounts {
    /// Entries of `/etc/passwd`.
    pub users: Vec<User>,
    /// Entries of `/etc/group`.
    pub groups: Vec<Group>,
}

/// Parses `/etc/passwd` content; malformed lines are skipped rather than failing the lookup,
/// since a single bad line must not lock everyone out.
pub fn parse_passwd(content: &str) -> Vec<User> {
    records(content, 7)
        .filter_map(|fields| {
            Some(User {
                name: fields[0].to_owned(),
                uid: fields[2].parse().ok()?,
                gid: fields[3].parse().ok()?,
                home: PathBuf::from(if fields[5].is_empty() { "/" } else { fields[5] }),
                shell: fields[6].to_owned(),
            })
        })
        .collect()
}

/// Parses `/etc/group` content, skipping malformed lines.
pub fn parse_group(content: &str) -> Vec<Group> {
    records(content, 3)
        .filter_map(|fields| {
            let members = fields
                .get(3)
                .map(|m| {
                    m.split(',')
                        .filter(|s| !s.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            Some(Group {
                name: fields[0].to_owned(),
                gid: fields[2].parse().ok()?,
                members,
            })
        })
        .collect()
}

/// The colon-separated fields of each record of a passwd-style file with at least `fields`
/// of them; blank lines, comments and shorter lines are skipped.
fn records(content: &str, fields: usize) -> impl Iterator<Item = Vec<&str>> {
    content
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|line| line.split(':').collect::<Vec<&str>>())
        .filter(move |record| record.len() >= fields)
}

fn read_optional(path: &Path) -> Result<String, UserError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(source) => Err(UserError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

impl Accounts {
    /// Reads the system's account files. They are re-read per call on purpose: users may be
    /// added inside the sandbox at any time (`useradd` in a template step or a command).
    pub fn load() -> Result<Self, UserError> {
        Ok(Self {
            users: parse_passwd(&read_optional(Path::new("/etc/passwd"))?),
            groups: parse_group(&read_optional(Path::new("/etc/group"))?),
        })
    }

    /// Looks a user up by name.
    pub fn user(&self, name: &str) -> Result<User, UserError> {
        self.users
            .iter()
            .find(|u| u.name == name)
            .cloned()
            .ok_or_else(|| UserError::UnknownUser(name.to_owned()))
    }

    /// Name for a uid, or the number as text when it has no entry (as `ls` does).
    pub fn user_name(&self, uid: u32) -> String {
        self.users
            .iter()
            .find(|u| u.uid == uid)
            .map_or_else(|| uid.to_string(), |u| u.name.clone())
    }

    /// Name for a gid, or the number as text.
    pub fn group_name(&self, gid: u32) -> String {
        self.groups
            .iter()
            .find(|g| g.gid == gid)
            .map_or_else(|| gid.to_string(), |g| g.name.clone())
    }

    /// Primary plus supplementary group ids of a user, primary first, without duplicates.
    pub fn group_ids(&self, user: &User) -> Vec<u32> {
        let mut ids = vec![user.gid];
        for group in &self.groups {
            if group.members.iter().any(|m| m == &user.name) && !ids.contains(&group.gid) {
                ids.push(group.gid);
            }
        }
        ids
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        # comment\n\
        broken line\n\
        user:x:1000:1000:,,,:/home/user:/bin/bash\n\
        nohome:x:1001:1001::::\n";
    const GROUP: &str = "root:x:0:\nuser:x:1000:\nsudo:x:27:user,other\ndocker:x:999:other\n";

    #[test]
    fn parses_passwd_and_skips_bad_lines() {
        let users = parse_passwd(PASSWD);
        assert_eq!(users.len(), 3);
        assert_eq!(users[1].name, "user");
        assert_eq!(users[1].uid, 1000);
        assert_eq!(users[1].home, PathBuf::from("/home/user"));
        assert_eq!(users[1].shell, "/bin/bash");
        assert_eq!(users[2].home, PathBuf::from("/"));
    }

    #[test]
    fn resolves_groups_and_names() {
        let accounts = Accounts {
            users: parse_passwd(PASSWD),
            groups: parse_group(GROUP),
        };
        let user = accounts.user("user").unwrap();
        assert_eq!(accounts.group_ids(&user), vec![1000, 27]);
        assert_eq!(accounts.user_name(0), "root");
        assert_eq!(accounts.user_name(4242), "4242");
        assert_eq!(accounts.group_name(999), "docker");
        assert!(
            matches!(accounts.user("nobody-here"), Err(UserError::UnknownUser(n)) if n == "nobody-here")
        );
    }
}
