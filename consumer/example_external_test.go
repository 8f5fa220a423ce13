package consumer_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
)

// postWithKey calls a partner API that honours Idempotency-Key and decodes its JSON
// answer into out.
func postWithKey(ctx context.Context, url, key string, body []byte, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err // a timeout: retried later, with the same key
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 400 && resp.StatusCode < 500 {
		return consumer.Permanent(fmt.Errorf("partner refused: %s", resp.Status))
	}
	if resp.StatusCode >= 300 {
		return fmt.Errorf("partner: %s", resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// An external effect in two steps — book a shipment with a carrier, then notify
// the customer — run as a consumer with a lease, heartbeats and recovery points.
// Each step presents its own key derived from the intent's, and records a recovery
// point, so a worker that dies mid-way is taken over from the last completed step
// and the step it was in is folded by the carrier.
func ExampleNewExternal() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}

	ship := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		var booking struct {
			ID string `json:"id"`
		}
		if e.Step == "" { // not booked yet (or the booking never reached its checkpoint)
			if err := postWithKey(ctx, "https://carrier.example/bookings", e.KeyFor("book"), e.Payload, &booking); err != nil {
				return nil, err
			}
			if err := e.Checkpoint(ctx, "booked", []byte(booking.ID)); err != nil {
				return nil, err
			}
		}
		booking.ID = string(e.StepState) // the recovery point: set by us or by a dead worker
		var sent struct{}
		if err := postWithKey(ctx, "https://notify.example/messages", e.KeyFor("notify"), []byte(booking.ID), &sent); err != nil {
			return nil, err
		}
		return json.Marshal(booking) // stored as the key's first result
	})

	x, err := consumer.NewExternal(pool, js, consumer.ExternalConfig{
		Name:     "shipments",
		Subject:  "idem.shipments.book",
		Handler:  ship,
		LeaseFor: time.Minute, // how long a crashed worker holds up the retry
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := x.Run(ctx); err != nil { // until Ctrl-C; in-flight effects finish
		log.Fatal(err)
	}
}
