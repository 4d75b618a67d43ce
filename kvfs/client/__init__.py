"""The aware-client library engines import (kvfs.client.direct) and the engine adapters."""
