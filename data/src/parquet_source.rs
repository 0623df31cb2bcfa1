//! Reading Parquet objects from any store by byte ranges, so the planner
//! reads only footers and workers only their row groups.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::ArrowReaderOptions;
use parquet::arrow::async_reader::AsyncFileReader;
use parquet::errors::ParquetError;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};

use stoke_store::StoreError;
use stoke_store::{StoreUri, Stores};

/// Bytes read at once from the end of a file to find its footer.
const FOOTER_PREFETCH: usize = 64 * 1024;

/// An `AsyncFileReader` over one object of a store.
#[derive(Debug, Clone)]
pub struct ParquetSource {
    store: Arc<dyn ObjectStore>,
    path: Path,
    size: u64,
}

impl ParquetSource {
    /// Opens `uri`; `size` saves a HEAD request when the caller knows it.
    pub async fn open(
        stores: &Stores,
        uri: &StoreUri,
        size: Option<u64>,
    ) -> Result<Self, StoreError> {
        let (store, path) = stores.resolve(uri)?;
        let size = match size {
            Some(size) => size,
            None => stores.size(uri).await?,
        };
        Ok(Self { store, path, size })
    }
}

fn external(e: object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(e))
}

impl AsyncFileReader for ParquetSource {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        let store = Arc::clone(&self.store);
        let path = self.path.clone();
        async move { store.get_range(&path, range).await.map_err(external) }.boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        let store = Arc::clone(&self.store);
        let path = self.path.clone();
        async move { store.get_ranges(&path, &ranges).await.map_err(external) }.boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        Box::pin(async move {
            let size = self.size;
            let metadata = ParquetMetaDataReader::new()
                .with_metadata_options(options.map(|o| o.metadata_options().clone()))
                .with_prefetch_hint(Some(FOOTER_PREFETCH))
                .load_and_finish(self, size)
                .await?;
            Ok(Arc::new(metadata))
        })
    }
}
