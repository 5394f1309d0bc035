//! What a statement written once needs to know of the database it runs on. Each aggregate's
//! records are one type generic over its [`Backend`] (`Teams<B>`, …), and [`on_both!`]
//! compiles their trait impls once for each database, so the SQL, the bindings and the
//! reading of rows are written once.

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Pool, Postgres, Sqlite};

use crate::SqliteDb;
use crate::rows::Stamp;

/// A database the records are kept in.
pub(crate) trait Backend {
    type Db: sqlx::Database;
    /// A time as a column of this database holds it.
    type Time: Stamp;

    /// Where a statement that only reads runs.
    fn reads(&self) -> &Pool<Self::Db>;

    /// Where every statement or transaction that writes runs.
    fn writes(&self) -> &Pool<Self::Db>;

    fn time(t: DateTime<Utc>) -> Self::Time;

    /// `sqlite` or `postgres`, whichever is this database's: for the part of a statement
    /// their dialects write differently.
    fn either<T>(sqlite: T, postgres: T) -> T;
}

impl Backend for SqliteDb {
    type Db = Sqlite;
    type Time = i64;

    fn reads(&self) -> &Pool<Sqlite> {
        &self.reads
    }

    fn writes(&self) -> &Pool<Sqlite> {
        &self.writes
    }

    fn time(t: DateTime<Utc>) -> i64 {
        crate::micros(t)
    }

    fn either<T>(sqlite: T, _: T) -> T {
        sqlite
    }
}

/// One pool for both: PostgreSQL has no single writer to keep reads away from.
impl Backend for PgPool {
    type Db = Postgres;
    type Time = DateTime<Utc>;

    fn reads(&self) -> &PgPool {
        self
    }

    fn writes(&self) -> &PgPool {
        self
    }

    fn time(t: DateTime<Utc>) -> DateTime<Utc> {
        t
    }

    fn either<T>(_: T, postgres: T) -> T {
        postgres
    }
}

/// `$items` compiled once for each database, with `B` naming its [`Backend`] and `Time` its
/// time column. Compiled against concrete types rather than generic over `sqlx::Database`:
/// sqlx's bounds on a generic database would outweigh the statements they serve.
macro_rules! on_both {
    ($($items:item)*) => {
        const _: () = {
            type B = crate::SqliteDb;
            // Not every aggregate keeps a time.
            #[allow(dead_code)]
            type Time = <B as crate::backend::Backend>::Time;
            $($items)*
        };
        const _: () = {
            type B = sqlx::PgPool;
            // Not every aggregate keeps a time.
            #[allow(dead_code)]
            type Time = <B as crate::backend::Backend>::Time;
            $($items)*
        };
    };
}
