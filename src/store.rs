//! SQLite persistence: the only code that speaks SQL. Every write is one
//! transaction committed before the caller answers a client, so a `kill -9`
//! of the daemon loses nothing it acknowledged.

use std::path::Path;

use rusqlite::{params, Connection};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sqlite")]
    Sqlite(#[from] rusqlite::Error),
    #[error("decode stored run {id}")]
    Decode {
        id: String,
        #[source]
        source: serde_json::Error,
    },
}

pub struct Store {
    conn: Connection,
}

/// One stored run: the record as JSON plus the encrypted create-time env.
pub struct StoredRun {
    pub record: serde_json::Value,
    pub env_sealed: Option<Vec<u8>>,
}

impl Store {
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS runs (
                id TEXT PRIMARY KEY,
                status TEXT NOT NULL,
                record TEXT NOT NULL,
                env BLOB
            );
            CREATE TABLE IF NOT EXISTS run_events (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                run_id TEXT NOT NULL,
                status TEXT NOT NULL,
                at_ms INTEGER NOT NULL,
                message TEXT
            );
            CREATE INDEX IF NOT EXISTS run_events_run ON run_events(run_id);",
        )?;
        Ok(Store { conn })
    }

    /// Inserts or replaces a run and appends a history event, atomically.
    pub fn put_run(
        &mut self,
        id: &str,
        status: &str,
        record: &serde_json::Value,
        env_sealed: Option<&[u8]>,
        event: Option<(&str, i64)>,
    ) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        // Cached: a run is written twice per create; parsing the SQL each
        // time was a good part of the write.
        tx.prepare_cached(
            "INSERT INTO runs (id, status, record, env) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(id) DO UPDATE SET status = ?2, record = ?3,
               env = COALESCE(?4, runs.env)",
        )?
        .execute(params![id, status, record.to_string(), env_sealed])?;
        if let Some((message, at_ms)) = event {
            tx.prepare_cached(
                "INSERT INTO run_events (run_id, status, at_ms, message) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![id, status, at_ms, message])?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Forgets a run's stored env (it is dead; nothing will exec again).
    pub fn drop_env(&mut self, id: &str) -> Result<(), StoreError> {
        self.conn
            .execute("UPDATE runs SET env = NULL WHERE id = ?1", params![id])?;
        Ok(())
    }

    pub fn delete_run(&mut self, id: &str) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        tx.execute("DELETE FROM runs WHERE id = ?1", params![id])?;
        tx.execute("DELETE FROM run_events WHERE run_id = ?1", params![id])?;
        tx.commit()?;
        Ok(())
    }

    pub fn load_runs(&self) -> Result<Vec<StoredRun>, StoreError> {
        let mut stmt = self
            .conn
            .prepare("SELECT id, record, env FROM runs ORDER BY id")?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<Vec<u8>>>(2)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, record, env) = row?;
            let record = serde_json::from_str(&record)
                .map_err(|source| StoreError::Decode { id, source })?;
            out.push(StoredRun {
                record,
                env_sealed: env,
            });
        }
        Ok(out)
    }

    /// The status history of a run, oldest first: (status, at_ms, message).
    pub fn history(&self, id: &str) -> Result<Vec<(String, i64, Option<String>)>, StoreError> {
        let mut stmt = self.conn.prepare(
            "SELECT status, at_ms, message FROM run_events WHERE run_id = ?1 ORDER BY seq",
        )?;
        let rows = stmt.query_map(params![id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_history_survive_reopen() {
        let dir = tempfile::tempdir().expect("tmp");
        let db = dir.path().join("sbx.db");
        {
            let mut s = Store::open(&db).expect("open");
            s.put_run(
                "A",
                "creating",
                &serde_json::json!({"id": "A"}),
                Some(b"sealed"),
                Some(("", 1)),
            )
            .expect("put");
            s.put_run(
                "A",
                "running",
                &serde_json::json!({"id": "A", "x": 1}),
                None,
                Some(("up", 2)),
            )
            .expect("put");
        }
        let mut s = Store::open(&db).expect("reopen");
        let runs = s.load_runs().expect("load");
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].record["x"], 1);
        assert_eq!(
            runs[0].env_sealed.as_deref(),
            Some(&b"sealed"[..]),
            "env kept when not given"
        );
        let h = s.history("A").expect("history");
        assert_eq!(
            h.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
            vec!["creating", "running"]
        );
        s.drop_env("A").expect("drop env");
        assert_eq!(s.load_runs().expect("load")[0].env_sealed, None);
        s.delete_run("A").expect("delete");
        assert!(s.load_runs().expect("load").is_empty());
        assert!(s.history("A").expect("history").is_empty());
    }
}
