//! What a statement written once needs to know of the database it runs on. Each aggregate's
//! records are one type generic over its [`Backend`] (`Teams<B>`, …), and [`on_both!`]
//! compiles their trait impls once for each database, so the SQL, the bindings and the
//! reading of rows are written once.

use std::future::Future;

use chrono::{DateTime, Utc};
use sandbar_core::StoreError;
use sqlx::query::{Query, QueryAs};
use sqlx::{Database, FromRow, PgPool, Pool, Postgres, Sqlite, Transaction};

use crate::SqliteDb;
use crate::rows::Stamp;
use crate::{err, insert_err};

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

/// A statement that writes, run on the writer of its database. Every write goes through here,
/// [`Transact`], a transaction begun on [`Backend::writes`], or (for an `INSERT … RETURNING`)
/// a fetch on it, so none can land on a SQLite reader.
pub(crate) trait Write<B: Backend> {
    /// Runs the statement and answers how many rows it changed.
    fn write(self, db: &B) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Runs the statement, whichever rows it changed.
    fn run(self, db: &B) -> impl Future<Output = Result<(), StoreError>> + Send
    where
        Self: Sized,
    {
        let write = self.write(db);
        async move {
            write.await?;
            Ok(())
        }
    }

    /// Runs an insert of `what` `id`: a row already holding its key is a
    /// [`StoreError::Conflict`] naming it.
    fn insert(
        self,
        db: &B,
        what: &'static str,
        id: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// A statement that writes, as [`Write`] and [`Transact`] run it on database `B`.
pub(crate) type Statement<'q, B> =
    Query<'q, <B as Backend>::Db, <<B as Backend>::Db as Database>::Arguments>;

/// Statements that write together or not at all: one transaction on the writer.
pub(crate) trait Transact: Backend {
    /// Runs `statements` in order.
    fn write_all(
        &self,
        statements: Vec<Statement<'_, Self>>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Runs an insert of `what` `id`, then the `rest` that goes with it: a row already holding
    /// the insert's key is a [`StoreError::Conflict`] naming it.
    fn insert_with(
        &self,
        insert: Statement<'_, Self>,
        what: &'static str,
        id: &str,
        rest: Vec<Statement<'_, Self>>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// A statement that reads rows of `R`, run on a reader, each row turned into the record it
/// holds.
pub(crate) trait Read<B: Backend, R> {
    fn all<T>(self, db: &B) -> impl Future<Output = Result<Vec<T>, StoreError>> + Send
    where
        T: TryFrom<R, Error: Into<StoreError>> + Send;

    fn one<T>(self, db: &B) -> impl Future<Output = Result<Option<T>, StoreError>> + Send
    where
        T: TryFrom<R, Error: Into<StoreError>> + Send;
}

/// [`Write`], [`Transact`] and [`Read`] for one database: the same text for both,
/// compiled against each one's concrete types.
macro_rules! statement_runners {
    ($backend:ty) => {
        impl<'q> Write<$backend> for Statement<'q, $backend> {
            async fn write(self, db: &$backend) -> Result<u64, StoreError> {
                Ok(self
                    .execute(db.writes())
                    .await
                    .map_err(err)?
                    .rows_affected())
            }

            async fn insert(
                self,
                db: &$backend,
                what: &'static str,
                id: &str,
            ) -> Result<(), StoreError> {
                self.execute(db.writes())
                    .await
                    .map_err(insert_err(what, id))?;
                Ok(())
            }
        }

        const _: () = {
            /// Runs `statements` in `tx`, in order, then commits it.
            async fn commit_after(
                mut tx: Transaction<'static, <$backend as Backend>::Db>,
                statements: Vec<Statement<'_, $backend>>,
            ) -> Result<(), StoreError> {
                for statement in statements {
                    statement.execute(&mut *tx).await.map_err(err)?;
                }
                tx.commit().await.map_err(err)
            }

            impl Transact for $backend {
                async fn write_all(
                    &self,
                    statements: Vec<Statement<'_, Self>>,
                ) -> Result<(), StoreError> {
                    let tx = self.writes().begin().await.map_err(err)?;
                    commit_after(tx, statements).await
                }

                async fn insert_with(
                    &self,
                    insert: Statement<'_, Self>,
                    what: &'static str,
                    id: &str,
                    rest: Vec<Statement<'_, Self>>,
                ) -> Result<(), StoreError> {
                    let mut tx = self.writes().begin().await.map_err(err)?;
                    insert
                        .execute(&mut *tx)
                        .await
                        .map_err(insert_err(what, id))?;
                    commit_after(tx, rest).await
                }
            }
        };

        impl<'q, R> Read<$backend, R>
            for QueryAs<
                'q,
                <$backend as Backend>::Db,
                R,
                <<$backend as Backend>::Db as Database>::Arguments,
            >
        where
            R: for<'r> FromRow<'r, <<$backend as Backend>::Db as Database>::Row> + Send + Unpin,
        {
            async fn all<T>(self, db: &$backend) -> Result<Vec<T>, StoreError>
            where
                T: TryFrom<R, Error: Into<StoreError>> + Send,
            {
                self.fetch_all(db.reads())
                    .await
                    .map_err(err)?
                    .into_iter()
                    .map(|row| T::try_from(row).map_err(Into::into))
                    .collect()
            }

            async fn one<T>(self, db: &$backend) -> Result<Option<T>, StoreError>
            where
                T: TryFrom<R, Error: Into<StoreError>> + Send,
            {
                self.fetch_optional(db.reads())
                    .await
                    .map_err(err)?
                    .map(|row| T::try_from(row).map_err(Into::into))
                    .transpose()
            }
        }
    };
}

statement_runners!(SqliteDb);
statement_runners!(PgPool);
