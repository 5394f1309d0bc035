-- Template layers published to the cluster's layer store, by layer name.
CREATE TABLE layer_blobs (
    layer TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    size_bytes BIGINT NOT NULL,
    node_id TEXT NOT NULL,
    published_at TIMESTAMPTZ NOT NULL
);
