# The idem worker image used by docker-compose.yml.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -o /out/worker ./cmd/worker && CGO_ENABLED=0 go build -o /out/enqueue ./cmd/enqueue

FROM debian:bookworm-slim
COPY --from=build /out/worker /out/enqueue /usr/local/bin/
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/worker"]
