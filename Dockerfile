# The idem worker image used by docker-compose.yml: the worker and cmd/enqueue,
# static binaries on Debian slim, run as an unprivileged user.
FROM golang:1.26.8-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -o /out/worker ./cmd/worker && CGO_ENABLED=0 go build -trimpath -o /out/enqueue ./cmd/enqueue

FROM debian:12.12-slim
# CA certificates, for a DATABASE_URL, NATS_URL or OTLP endpoint over TLS.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# The worker runs as idem (uid 10001), not root. Its data dir holds only its lock
# and its database record here (Postgres and NATS are services of their own), and
# must belong to it and be closed to other users, which the worker checks.
RUN useradd --system --uid 10001 --user-group --home-dir /home/idem --create-home --shell /usr/sbin/nologin idem \
 && install -d -o idem -g idem -m 0700 /var/lib/idem
ENV IDEM_DATA_DIR=/var/lib/idem
COPY --from=build /out/worker /out/enqueue /usr/local/bin/
USER 10001:10001
WORKDIR /home/idem
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/worker"]
